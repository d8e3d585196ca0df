"""Where a prefill step's device time goes: one eager prefill of ``--batch-size`` prompts of ``--input-len`` tokens
under the torch profiler, after a first prefill of other prompts has compiled and tuned every kernel.

    python tools/profiling/profile_prefill.py MODEL [--dummy] [--input-len 8192] [--batch-size 1] [--top 30]

Prints one JSON line: the step's wall time, the device's busy time (the sum of kernel and copy times), prefill
tokens/s, and the kernels by device time (name, ms in the step, launches), largest first.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy, dtype bfloat16")
    args = parser.parse_args()
    extra = {"load_format": "dummy", "dtype": "bfloat16"} if args.dummy else {}
    tokens = args.input_len * args.batch_size
    llm = LLM(args.model, max_num_seqs=args.batch_size, enforce_eager=True, max_num_batched_tokens=tokens, **extra)
    engine, vocab = llm.engine, llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # the CPU: a dry run of the script

    def prefill(seed: int) -> float:
        for i in range(args.batch_size):  # fresh token ids per call: the prefix cache never shortens the prefill
            llm.submit([(977 * i + 31 * j + 7919 * seed) % (vocab - 3) + 3 for j in range(args.input_len)], params)
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        wall = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        return wall

    prefill(0)
    activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        traced = prefill(1)
    wall = prefill(2)
    kernels = prof.key_averages()
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    print(json.dumps({
        "model": args.model, "input_len": args.input_len, "batch": args.batch_size,
        "step_wall_ms": round(wall * 1e3, 2), "prefill_tokens_per_s": round(tokens / wall),
        "traced_step_wall_ms": round(traced * 1e3, 2), "device_busy_ms": round(busy_ms, 2),
        "launches": sum(e.count for e in kernels),
        "top_kernels": [[e.key[:80], round(e.self_device_time_total / 1e3, 3), e.count]
                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]],
    }))


if __name__ == "__main__":
    main()
