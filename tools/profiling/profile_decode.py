"""Where a decode step's device time goes, and how long the device sits idle between steps.

    python tools/profiling/profile_decode.py MODEL_DIR --batch-size 16 [--steps 8] [--dummy]            kernels per eager step
    python tools/profiling/profile_decode.py MODEL_DIR --batch-size 16 --steps 64 --graphs [--dummy]    idle share, replaying

Eager (the default), every kernel of a decode step is its own launch: the profiler's table and the launch count
per step. With ``--graphs`` the steps replay CUDA graphs as in serving (asynchronous scheduling as
DEEPINFER_ASYNC_SCHEDULING says), timed three ways:

- ``step_wall_ms``: the host's wall time per step over ``--steps`` steps, nothing attached to the process;
- ``device_step_ms``: the device's own time per step, from the engine's CUDA events around each step, with every
  step launched while the device spins on a sleep kernel (so the host is ahead, and the events time the step's
  kernels and copies, not the host);
- ``idle_share`` = 1 - device_step_ms / step_wall_ms: the share of a step the device waits for the host.

``--trace`` adds a run under the torch profiler: kernels by device time per step, and the idle share as the part of
the span no kernel or copy covers (``trace_idle_share``; ``trace_between_steps_idle_share`` counts only the gaps after
the copies that end a step and start the next). The profiler's CUPTI callbacks slow the host's launch of every graph
node, so its step is longer than the untraced one on host-bound models: the untraced figures are the measurement.
With programmatic dependent launch (``DEEPINFER_DEPENDENT_LAUNCH``, on by default) a kernel starts before the one
before it ends and waits inside, so its traced time holds part of its predecessor's: ``top_kernels`` attributes
time per kernel only with it off (an H100's V4.1 step: the mHC sublayer input 15.4 us a call with it, 9.0
without), which the output's ``dependent_launch`` says. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer import LLM, SamplingParams, envs


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


SLEEP_CYCLES = 20_000_000  # about 10 ms at an H200's clock: longer than the host takes to launch any step here


def device_step_ms(engine, steps: int) -> float:
    """Device time per step with the host ahead: each step launched behind a sleep kernel, timed by its own events
    (``StepMetrics.device``; with asynchronous scheduling the last step's is not waited for, hence ``device_steps``)."""
    for i in range(steps + 1):
        torch.cuda._sleep(SLEEP_CYCLES)
        engine.step()
        if i == 0:  # it timed the step launched before the loop, without a sleep
            engine.step_metrics.reset()
    torch.cuda.synchronize()
    return engine.step_metrics.device * 1e3 / max(engine.step_metrics.device_steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--graphs", action="store_true", help="replay CUDA graphs and report the device idle share")
    parser.add_argument("--trace", action="store_true", help="with --graphs: also run the steps under the torch "
                        "profiler (kernels by device time, the trace's idle share)")
    parser.add_argument("--host-profile", action="store_true", help="with --graphs: where the host's time goes "
                        "(cProfile of the same steps, run again without the device profiler)")
    parser.add_argument("--top", type=int, default=30, help="with --graphs: how many kernels to list by device time")
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy, dtype bfloat16")
    args = parser.parse_args()
    extra = {"load_format": "dummy", "dtype": "bfloat16"} if args.dummy else {}
    llm = LLM(args.model, max_num_seqs=args.batch_size, enforce_eager=not args.graphs, max_num_batched_tokens=8192,
              **extra)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=5 * args.steps + 8, ignore_eos=True)
    for i in range(args.batch_size):
        llm.submit([(977 * i + 31 * j) % (vocab - 3) + 3 for j in range(args.input_len)], params)
    engine = llm.engine
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(2):  # the first decode steps: graphs captured, nothing left to tune or allocate
        engine.step()
    torch.cuda.synchronize()
    if args.graphs:
        print(json.dumps(measure_replayed(engine, args)))
        return
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


def measure_replayed(engine, args) -> dict:
    engine.step_metrics.reset()
    preempted, graphs = engine.scheduler.num_preemptions, len(engine.graphs.graphs) if engine.graphs else 0
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
    host_ms = {k: round(v, 3) for k, v in engine.step_metrics.per_step_ms().items()}
    device_ms = device_step_ms(engine, args.steps)
    measured = {
        "model": args.model, "batch": args.batch_size, "steps": args.steps,
        "async_scheduling": engine.async_scheduling, "dependent_launch": envs.get().DEEPINFER_DEPENDENT_LAUNCH,
        "step_wall_ms": round(wall_ms, 3), "tokens_per_s": round(args.batch_size * 1e3 / wall_ms, 1),
        "device_step_ms": round(device_ms, 3), "idle_share": round(max(0.0, 1 - device_ms / wall_ms), 4),
        "step_ms": host_ms,
        # either makes some measured steps eager (recomputed prefills, a capture's warm-up run)
        "preemptions_while_measured": engine.scheduler.num_preemptions - preempted,
        "graphs_captured_while_measured": (len(engine.graphs.graphs) if engine.graphs else 0) - graphs,
    }
    if args.trace:
        engine.step_metrics.reset()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            traced_ms = (time.perf_counter() - start) * 1e3 / args.steps
        busy, span = busy_and_span_us(prof)
        kernels = prof.key_averages()
        measured |= {
            "traced_step_wall_ms": round(traced_ms, 3),
            "traced_step_ms": {k: round(v, 3) for k, v in engine.step_metrics.per_step_ms().items()},
            "trace_device_busy_ms_per_step": round(busy / 1e3 / args.steps, 3),
            "trace_idle_share": round(1 - busy / span, 4) if span else None,
            "trace_between_steps_idle_share": round(between_steps_idle_us(prof) / span, 4) if span else None,
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
    return measured


if __name__ == "__main__":
    main()
