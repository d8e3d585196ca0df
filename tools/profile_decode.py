"""Where a decode step's device time goes: kernels of eager decode steps only (prefill finished first).

    python tools/profile_decode.py MODEL_DIR --batch-size 16 [--steps 8] [--dummy]

Eager, because a replayed CUDA graph shows as one launch; the kernels and their times are the same, the graph
only removes the launch gaps. Prints the profiler's table and the launch count per step.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy, dtype bfloat16")
    args = parser.parse_args()
    extra = {"load_format": "dummy", "dtype": "bfloat16"} if args.dummy else {}
    llm = LLM(args.model, max_num_seqs=args.batch_size, enforce_eager=True, max_num_batched_tokens=8192, **extra)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for i in range(args.batch_size):
        llm._submit([(977 * i + 31 * j) % (vocab - 3) + 3 for j in range(args.input_len)], params)
    engine = llm.engine
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()  # first decode step: nothing left to tune or allocate
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events)  # only CUDA activity was recorded: kernels and copies
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"batch {args.batch_size}: {launches / args.steps:.0f} kernels and {device_us / args.steps / 1e3:.2f} ms "
          f"of device time per decode step")
    print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
