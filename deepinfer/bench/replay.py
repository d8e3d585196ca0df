"""``deepinfer bench replay``: prefill throughput with SWA bounded replay off and compact, and what it changes.

Each mode loads the model once (``prefill_truncation_mode="off"``, then ``"compact"`` with
``--keep-tokens``), warms up, times prefilling ``--batch-size`` prompts of ``--input-len`` tokens (one output
token), then generates ``--output-len`` greedy tokens from them. Reported: prefill tokens/s of both and the
speed-up, how far compact's last-position logits are from full prefill's (max absolute difference over the
largest logit, per prompt), and greedy agreement: the tokens before the first difference, per prompt.
Prompts are token ids drawn from ``--seed``, or windows of ``--text-file`` (natural text means more to a trained
model such as the embedded one).
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.bench.throughput import _add_common, _synchronize, build_llm, releases_engine

def _prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    if args.text_file:
        with open(args.text_file) as f:
            ids = tokenizer.encode(f.read())
        if len(ids) < args.input_len + args.batch_size:
            raise SystemExit(f"--text-file has {len(ids)} tokens; {args.input_len} per prompt need more")
        step = max(1, (len(ids) - args.input_len) // args.batch_size)
        return [ids[i * step:i * step + args.input_len] for i in range(args.batch_size)]
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, vocab, (args.batch_size, args.input_len), generator=g).tolist()


@releases_engine
def _run(args, mode: str, prompts: list[list[int]] | None) -> dict:
    from deepinfer import SamplingParams

    llm = build_llm(args, max_num_seqs=args.batch_size, prefill_truncation_mode=mode,
                    prefill_keep_tokens=args.keep_tokens,
                    max_model_len=args.max_model_len or args.input_len + args.output_len + 8,
                    enable_prefix_caching=False)  # every timed prefill computes its prompts (compact's would miss)
    if mode == "compact" and llm.engine.truncation is None:
        raise SystemExit("no prefill truncation plugin serves compact mode (is features/swa_replay installed?)")
    if prompts is None:  # drawn once: both modes must see the same prompts, whatever happens to --text-file
        prompts = _prompts(args, llm.tokenizer, llm.engine.model_config.vocab_size)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, one, use_tqdm=False)  # warm-up
    model = llm.engine.model
    project, captured = model.project_vocab, []
    model.project_vocab = lambda hidden: captured.append(project(hidden)) or captured[-1]
    _synchronize()
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    _synchronize()
    elapsed = time.perf_counter() - start
    model.project_vocab = project
    logits = torch.cat(captured).float().cpu()  # each prompt's last position, in step order (one step or chunks)
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    result = {"prefill_tokens_per_second": len(prompts) * args.input_len / elapsed, "last_logits": logits,
              "token_ids": [o.outputs[0].token_ids for o in outputs], "prompts": prompts}
    return result


def _agreement(a: list[int], b: list[int]) -> int:
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    return same


def run(args, vocab: int) -> dict:
    if args.compare_hf:
        raise SystemExit("bench replay compares DeepInfer with itself: --compare-hf does not apply")
    off = _run(args, "off", None)
    compact = _run(args, "compact", off["prompts"])
    scale = off["last_logits"].abs().amax(dim=-1)
    deviation = ((compact["last_logits"] - off["last_logits"]).abs().amax(dim=-1) / scale).tolist()
    agreement = [_agreement(a, b) for a, b in zip(off["token_ids"], compact["token_ids"])]
    return {
        "keep_tokens": args.keep_tokens,
        "prefill_tokens_per_second": {"off": off["prefill_tokens_per_second"],
                                      "compact": compact["prefill_tokens_per_second"]},
        "speedup": compact["prefill_tokens_per_second"] / off["prefill_tokens_per_second"],
        "last_logits_max_deviation_over_max_logit": deviation,
        "greedy_tokens_before_first_difference": agreement,
        "greedy_identical_prompts": sum(a == args.output_len for a in agreement),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--keep-tokens", type=int, default=140, help="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS for compact")
    parser.add_argument("--text-file", help="prompts are windows of this file's tokens (default: random ids)")
    parser.set_defaults(run=run)
