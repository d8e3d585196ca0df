"""``deepinfer bench fullscale``: one model across ``--ranks`` GPUs, attention data-parallel and experts
expert-parallel (DeepSeek-V4.1-Flash at full size does not fit one GPU, so there is no one-rank peer).

Reported: the engine's load time; rank 0's device memory once loaded (``torch.cuda.memory_allocated``; the ranks
hold the same share, and ``nvidia-smi`` shows each); prefill tokens/s with one ``--prefill-len`` prompt per rank;
decode tokens/s per GPU at each of ``--batch-sizes`` (sequences per rank), as ``bench latency`` measures it: a
batch generating ``--output-len`` tokens less the same batch generating one, over the tokens between. Every timed
batch has fresh prompts (no prefix-cache hit) and follows a warm-up of its shape (kernels compiled, graphs
captured). Speculative decoding is on when the environment turns it on (``DEEPINFER_ENABLE_MTP_VARLEN=1``); the
run records which, and rank 0's mean acceptance length. Each rank drafts for its own requests: the draft stages'
experts are not split over the ranks, so draft passes need no exchange.
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.bench.throughput import _add_common, _prompts, build_llm, timed_generate


def run(args, vocab: int) -> dict:
    from deepinfer import SamplingParams
    from deepinfer.envs import get as env

    ranks = args.ranks
    if ranks < 1 or min(args.batch_sizes) < 1 or args.output_len < 2 or args.prefill_len < 1:
        raise ValueError(f"--ranks, --batch-sizes and --prefill-len must be at least 1 and --output-len at least 2 "
                         f"(decode is timed between the first token and the last), got {ranks}, {args.batch_sizes}, "
                         f"{args.prefill_len} and {args.output_len}")
    if args.compare_hf:
        raise ValueError("--compare-hf: HF transformers cannot hold the model this bench is for on one GPU")
    start = time.perf_counter()
    llm = build_llm(args, max_num_seqs=max(args.batch_sizes), data_parallel_size=ranks,
                    enable_expert_parallel=ranks > 1)
    results = {"ranks": ranks, "speculative_decoding": bool(env().DEEPINFER_ENABLE_MTP_VARLEN),
               "load_time_s": time.perf_counter() - start}
    if torch.cuda.is_available():
        results["rank0_memory_allocated_GB"] = torch.cuda.memory_allocated() / 1e9
    seed = iter(range(args.seed, args.seed + 1_000_000))

    def timed(count: int, length: int, output_len: int) -> float:
        """Seconds for ``count`` fresh prompts of ``length`` ids to generate ``output_len`` tokens each, after a
        warm-up of the same shape."""
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(_prompts(count, length, vocab, next(seed)), params, use_tqdm=False)
        return timed_generate(llm, _prompts(count, length, vocab, next(seed)), params)[0]

    prefill = timed(ranks, args.prefill_len, 1)
    results["prefill"] = {"prompt_len": args.prefill_len, "prompts": ranks, "seconds": prefill,
                          "tokens_per_second": ranks * args.prefill_len / prefill}
    results["decode"] = []
    for batch in args.batch_sizes:
        whole, first = timed(batch * ranks, args.input_len, args.output_len), timed(batch * ranks, args.input_len, 1)
        per_gpu = batch * (args.output_len - 1) / (whole - first)
        results["decode"].append({"batch_per_gpu": batch, "tokens_per_second_per_gpu": per_gpu,
                                  "tokens_per_second": per_gpu * ranks, "seconds": whole})
    counters = llm.engine.counters()
    if "num_drafts" in counters and counters["num_drafts"]:
        results["mean_acceptance_length"] = 1 + counters["num_accepted_tokens"] / counters["num_drafts"]
    llm.close()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--ranks", type=int, default=8, help="GPUs (or processes on a CPU): data-parallel "
                        "attention, expert-parallel experts")
    parser.add_argument("--prefill-len", type=int, default=8192, help="prompt length of the prefill measurement")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256], help="sequences per GPU")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.set_defaults(run=run)
