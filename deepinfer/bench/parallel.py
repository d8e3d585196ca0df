"""``deepinfer bench parallel``: one rank against data parallelism, expert parallelism and EPLB, in one run.

The same ``--num-prompts`` prompts (``--input-len`` random token ids, or with ``--skewed`` ids from 16 values, so
routing piles onto few experts) generate ``--output-len`` greedy tokens (EOS ignored) with one rank, then with
``--ranks`` ranks as data parallelism, as context parallelism (every rank a share of every step's tokens), then
with the experts spread over the ranks, then with EPLB and
``--num-redundant-experts`` replicas. Each configuration runs the whole workload once before the timed run
(prefix caching off, so the timed run computes every prompt). Reported per
configuration: output tokens/s and its ratio to one rank; with expert parallelism the share of rank 0's time spent
dispatching and combining tokens (device time on GPUs: waiting for slower ranks included); with EPLB, for
each window of measured load, the max/mean rank load under the static split (no EPLB), under the placement that
served the window (fitted on the window before) and under the one refitted to it.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer.bench.throughput import _add_common, build_llm, releases_engine, timed_generate


def _prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    if args.skewed:
        values = torch.randint(3, vocab, (16,), generator=g)
        return values[torch.randint(0, 16, (args.num_prompts, args.input_len), generator=g)].tolist()
    return torch.randint(3, vocab, (args.num_prompts, args.input_len), generator=g).tolist()


def _configurations(args) -> dict[str, dict]:
    n = args.ranks
    return {
        "one_rank": {},
        f"data_parallel_{n}": {"data_parallel_size": n},
        f"context_parallel_{n}": {"context_parallel_size": n},
        f"expert_parallel_{n}": {"data_parallel_size": n, "enable_expert_parallel": True},
        f"eplb_{n}": {"data_parallel_size": n, "enable_expert_parallel": True, "enable_eplb": True,
                      "num_redundant_experts": args.num_redundant_experts,
                      "eplb_step_interval": args.eplb_step_interval},
    }


@releases_engine
def _run_one(args, prompts: list[list[int]], parallel: dict) -> dict:
    from deepinfer import SamplingParams

    llm = build_llm(args, max_num_seqs=args.num_prompts, enable_prefix_caching=False, **parallel)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # the whole workload once first: every kernel compiled and autotuned, every CUDA graph captured (a new
    # engine has an empty prefix cache, but this one keeps the warm-up's: it is off for the timed run's sake)
    llm.generate(prompts, params, use_tqdm=False)
    ep = llm.engine.expert_parallel
    if ep is not None:
        ep.exchange_time.reset()
        ep.balancedness.clear()
    elapsed, tokens = timed_generate(llm, prompts, params)
    result = {"elapsed_time": elapsed, "output_tokens": tokens, "output_tokens_per_second": tokens / elapsed}
    if ep is not None:
        result["exchange_share_of_time_rank0"] = ep.exchange_time.total() / elapsed
        if parallel.get("enable_eplb"):
            result["eplb_windows_max_over_mean_rank_load"] = [
                {"static": round(b.static, 4), "in_force": round(b.in_force, 4), "refitted": round(b.refitted, 4)}
                for b in ep.balancedness]
    llm.close()
    return result


def run(args, vocab: int) -> dict:
    prompts = _prompts(args, vocab)
    results = {name: _run_one(args, prompts, parallel) for name, parallel in _configurations(args).items()}
    base = results["one_rank"]["output_tokens_per_second"]
    for result in results.values():
        result["ratio_to_one_rank"] = result["output_tokens_per_second"] / base
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (GPUs, or processes on a CPU)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skewed", action="store_true", help="prompts of 16 distinct token ids: skewed routing")
    parser.add_argument("--num-redundant-experts", type=int, default=0)
    parser.add_argument("--eplb-step-interval", type=int, default=16)
    parser.set_defaults(run=run)
