"""Where a decode step's device time goes, and how long the device sits idle between steps (issue 7).

    python tools/profile_decode.py MODEL_DIR --batch-size 16 [--steps 8] [--dummy]            kernels per eager step
    python tools/profile_decode.py MODEL_DIR --batch-size 16 --steps 64 --graphs [--dummy]    idle share, replaying

Eager (the default), every kernel of a decode step is its own launch: the profiler's table and the launch count
per step. With ``--graphs`` the steps replay CUDA graphs as in serving (asynchronous scheduling as
DEEPINFER_ASYNC_SCHEDULING says); the profiler's kernel and copy intervals give the device's busy time, and the idle
share is the part of the span from the first step's first kernel to the last step's last one that no kernel or copy
covers; the between-steps share is the part of it after the copies that end a step and start the next, the rest being
the launch gaps between a step's kernels. Prints one JSON line with them, the step's
wall time and the engine's step metrics.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer import LLM, SamplingParams


def _device_intervals(prof) -> list[tuple[float, float, str]]:
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def busy_and_span_us(prof) -> tuple[float, float]:
    """Union of the device's kernel and copy intervals, and the span they lie in (microseconds)."""
    intervals = _device_intervals(prof)
    busy, end = 0.0, float("-inf")
    for start, stop, _ in intervals:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy, intervals[-1][1] - intervals[0][0] if intervals else 0.0


def between_steps_idle_us(prof) -> float:
    """Device idle time between steps: after each copy (a step ends with its sampled tokens' copy to the host, the next
    one starts with its inputs' copies), until the next operation starts. The rest of the idle time lies between the
    kernels of a step, mostly the launch gaps inside a replayed graph, which no host work can fill."""
    intervals = _device_intervals(prof)
    idle, end = 0.0, float("-inf")
    for (start, stop, name), following in zip(intervals, intervals[1:]):
        end = max(end, stop)
        if name.startswith("Memcpy"):
            idle += max(0.0, following[0] - end)
    return idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--graphs", action="store_true", help="replay CUDA graphs and report the device idle share")
    parser.add_argument("--host-profile", action="store_true", help="with --graphs: where the host's time goes "
                        "(cProfile of the same steps, run again without the device profiler)")
    parser.add_argument("--top", type=int, default=30, help="with --graphs: how many kernels to list by device time")
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy, dtype bfloat16")
    args = parser.parse_args()
    extra = {"load_format": "dummy", "dtype": "bfloat16"} if args.dummy else {}
    llm = LLM(args.model, max_num_seqs=args.batch_size, enforce_eager=not args.graphs, max_num_batched_tokens=8192,
              **extra)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 4, ignore_eos=True)
    for i in range(args.batch_size):
        llm._submit([(977 * i + 31 * j) % (vocab - 3) + 3 for j in range(args.input_len)], params)
    engine = llm.engine
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(2):  # the first decode steps: graphs captured, nothing left to tune or allocate
        engine.step()
    torch.cuda.synchronize()
    engine.step_metrics.reset()
    preempted, graphs = engine.scheduler.num_preemptions, len(engine.graphs.graphs) if engine.graphs else 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if args.graphs:
        busy, span = busy_and_span_us(prof)
        kernels = prof.key_averages()
        measured = {
            "model": args.model, "batch": args.batch_size, "steps": args.steps,
            "async_scheduling": engine.async_scheduling,
            "step_wall_ms": round(wall * 1e3 / args.steps, 3),
            "device_busy_ms_per_step": round(busy / 1e3 / args.steps, 3),
            "device_idle_share": round(1 - busy / span, 4) if span else None,
            "between_steps_idle_share": round(between_steps_idle_us(prof) / span, 4) if span else None,
            "step_ms": {k: round(v, 3) for k, v in engine.step_metrics.per_step_ms().items()},
            # either makes some measured steps eager (recomputed prefills, a capture's warm-up run)
            "preemptions_while_measured": engine.scheduler.num_preemptions - preempted,
            "graphs_captured_while_measured": (len(engine.graphs.graphs) if engine.graphs else 0) - graphs,
            "kernels_per_step": round(sum(e.count for e in kernels) / args.steps, 1),
            # where the replayed step's device time goes: [name, µs per step, launches per step], largest first
            "top_kernels": [[e.key[:70], round(e.self_device_time_total / args.steps, 1), e.count / args.steps]
                            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.top]],
        }
        if args.host_profile:
            import cProfile
            import pstats

            with cProfile.Profile() as host:
                for _ in range(args.steps):
                    engine.step()
            pstats.Stats(host).sort_stats("cumulative").print_stats(25)
        print(json.dumps(measured))
        return
    events = prof.key_averages()
    launches = sum(e.count for e in events)  # only CUDA activity was recorded: kernels and copies
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
    print(f"batch {args.batch_size}: {launches / args.steps:.0f} kernels and {device_us / args.steps / 1e3:.2f} ms "
          f"of device time per decode step")
    print(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
