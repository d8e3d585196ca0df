"""Where a speculative decoding step's time goes: graphs captured while timing, host ops and kernels per step.

    python tools/profiling/profile_speculative.py MODEL_DIR --batch-size 32 --synthetic-acceptance-length 2.8 [--dummy]

Runs ``--output-len`` tokens of each of ``--batch-size`` prompts twice with fixed-length drafts accepted at random
(``--synthetic-acceptance-length``): a warm-up, then the same run under the torch profiler (``--plain`` first does
the same without drafts, the peer). Reports the CUDA graphs (verification and draft) that the profiled run had to
capture (a steady run captures none: each capture is an eager step plus a capture, and a step that recaptures
every time is a defect), the engine's per-step phases, and the host ops and device kernels of the profiled run per
step. ``--eager-steps`` adds a run with ``enforce_eager=True`` for the same split without graphs. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer import LLM
from deepinfer.bench.speculative import PROMPTS, seeded_greedy
from deepinfer.bench.throughput import _synchronize, releases_engine


def _graph_counts(engine) -> dict[str, int]:
    drafter = engine.speculator.drafter if engine.speculator is not None else None
    drafts = getattr(getattr(drafter, "graphs", None), "graphs", {})
    return {"verification": len(engine.graphs.graphs) if engine.graphs is not None else 0, "draft": len(drafts)}


def _table(prof, key: str, top: int, steps: int) -> list[tuple[str, float, int]]:
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [(e.key[:90], round(getattr(e, key) / 1e3 / steps, 3), e.count) for e in events if getattr(e, key) > 0]


@releases_engine
def profile(args, drafts: bool, enforce_eager: bool) -> dict:
    options = ({"enable_mtp_varlen": False, "synthetic_acceptance_length": args.synthetic_acceptance_length}
               if drafts else {})
    llm = LLM(args.model, max_num_seqs=args.batch_size, enforce_eager=enforce_eager, **options,
              **({"load_format": "dummy", "dtype": "bfloat16"} if args.dummy else {}))
    engine = llm.engine
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch_size)]
    params = seeded_greedy(args.batch_size, args.output_len)  # the profiled run repeats the warm-up's batch sizes
    llm.generate(prompts, params, use_tqdm=False)
    before = _graph_counts(engine)
    engine.step_metrics.reset()
    _synchronize()
    start = time.perf_counter()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as prof:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _synchronize()
    wall = time.perf_counter() - start
    metrics = engine.step_metrics
    steps = max(metrics.steps, 1)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"drafts": drafts, "enforce_eager": enforce_eager, "batch_size": args.batch_size, "steps": metrics.steps,
              "tokens_per_request_step": round(tokens / args.batch_size / steps, 3),
              "wall_ms_per_step": round(wall * 1e3 / steps, 3),
              "per_step_ms": {k: round(v, 3) for k, v in metrics.per_step_ms().items()},
              "graphs_before": before, "graphs_after": _graph_counts(engine),
              "host_ops_ms_per_step": _table(prof, "self_cpu_time_total", args.top, steps),
              "kernels_ms_per_step": _table(prof, "self_device_time_total", args.top, steps)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--synthetic-acceptance-length", type=float, default=2.8)
    parser.add_argument("--dummy", action="store_true", help="load_format=dummy, dtype bfloat16")
    parser.add_argument("--eager-steps", action="store_true", help="also profile with enforce_eager=True")
    parser.add_argument("--plain", action="store_true", help="first profile plain decoding (no drafts), the peer")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for drafts in ([False] if args.plain else []) + [True]:
        for eager in [False] + ([True] if args.eager_steps else []):
            print(json.dumps(profile(args, drafts, eager)), flush=True)


if __name__ == "__main__":
    main()
