"""Do the measured policy's plain steps cost what decoding without drafts costs? (issue 42)

Runs the embedded model (or ``--model``) at one batch in one process: decoding without drafts, speculative decoding
with the measured policy forced to choose no drafts, forced to choose the longest, forced to alternate in runs
(``--pattern``: e.g. 8 decisions of the longest, then 4 of none), and left to choose (``measured``); reports tok/s,
the policy's booked step costs, and for the pattern and the policy's own choices every period (and the booked ones)
by its step's place in its run, and the last run's time outside them, so a booked cost can be set against the
steps' steady period and a run's transitions seen; and each mode's start (the prefill alone, and with the first
decode step) beside decoding without drafts'.

    python tools/profiling/policy_plain_steps.py --batch-size 32 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import time

from deepinfer import LLM, SamplingParams
from deepinfer.engine import draft_policy
from deepinfer.engine.run_clock import RunClock


# mode -> the policy's choice forced (0: plain, None: the longest), "pattern", or "measured" (its own)
FORCED = {"forced_plain": 0, "forced_longest": None, "pattern": "pattern", "measured": "measured"}


def _run(llm: LLM, prompts: list[str], params: SamplingParams, repeats: int) -> float:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: captures, compiles
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - started)
    return len(prompts) * params.max_tokens / best


def _start_ms(llm: LLM, prompts: list[str], repeats: int) -> dict[str, float]:
    """A run's start, best of ``repeats``: the prefill alone (one token asked for: with drafts, the drafter's store
    of the prompt too) and the prefill with the first decode step (its first decision and launch)."""
    start = {}
    for tokens in (1, 2):
        rate = _run(llm, prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), repeats)
        start[f"{tokens}_token{'s' if tokens > 1 else ''}_ms"] = round(len(prompts) * tokens / rate * 1e3, 3)
    return start


def _forced(args, engine: dict, prompts, params, forced) -> dict:
    """Speculative decoding with the policy's bookkeeping intact and its choice forced: 0 (plain steps), None (the
    longest drafts), "pattern" or "measured" (the policy's own choice); its tok/s, booked costs, launches and
    (pattern, measured) booked periods by place."""
    real_choose, real_record = draft_policy.choose, draft_policy.record_cost
    longest_run, plain_run = (int(n) for n in args.pattern.split(","))
    llm = LLM(args.model, enable_mtp_varlen=True, speculation_policy="measured", **engine)
    overlap, policy = llm.engine.overlap, llm.engine.speculator.policy
    decisions, booked, periods, gaps, last = [0], {}, {}, {}, [None]

    def choose(p, requests, choices):
        chosen = real_choose(p, requests, choices)  # its bookkeeping
        decisions[0] += 1
        if forced == "measured":
            return chosen
        if forced == "pattern":
            return (max(choices) if decisions[0] % (longest_run + plain_run) < longest_run else 0), "best"
        return (forced if forced is not None else max(choices)), "best"

    class Placing(RunClock):  # every period inside a run (booked or not) by its step's place in the run
        __slots__ = ()

        def note(self, requests, drafts, first):
            now = time.perf_counter()
            if not first and last[0] is not None:  # self.place: the step before's, whose period ends now
                periods.setdefault(f"k{drafts}/step{self.place}", []).append((now - last[0]) * 1e3)
            elif last[0] is not None:  # a run starts: the previous run's last launch to this one
                gaps.setdefault(f"to k{drafts}", []).append((now - last[0]) * 1e3)
            last[0] = now
            super().note(requests, drafts, first)

    def record(p, requests, k, seconds):  # the step booked is the last one noted: its place in its run
        booked.setdefault(f"k{k}/step{overlap.clock.place}", []).append(seconds * 1e3)
        real_record(p, requests, k, seconds)

    overlap.clock = Placing(policy)
    draft_policy.choose, draft_policy.record_cost = choose, record
    try:
        rate = _run(llm, prompts, params, args.repeats)
        # the last run alone: its wall time against the periods of its steps (the rest: prefill and transitions)
        periods.clear()
        gaps.clear()
        chosen_before = policy.chosen.copy()
        started = last[0] = time.perf_counter()  # the first gap: the prefill and the first launch's preparation
        llm.generate(prompts, params, use_tqdm=False)
        ended = time.perf_counter()
        last_run_ms, tail_ms = (ended - started) * 1e3, (ended - last[0]) * 1e3
        start = _start_ms(llm, prompts, args.repeats)
    finally:
        draft_policy.choose, draft_policy.record_cost = real_choose, real_record
    result = {"tok_s": rate, "ms_a_token": round(len(prompts) / rate * 1e3, 3),  # a request's wait per token
              "booked_ms": {f"b{b}/k{k}": round(s * 1e3, 3) for (b, k), s in sorted(policy.costs.items())},
              "launches": dict(overlap.launches), "start": start}
    if forced in ("pattern", "measured"):  # [periods, their median] by (length, the step's place in its run)
        result["booked_by_place_ms"] = _medians(booked)
        result["periods_by_place_ms"] = _medians(periods)
        result["last_run"] = {"ms": round(last_run_ms, 3), "in_periods_ms": round(sum(map(sum, periods.values())), 3),
                              "periods": sum(map(len, periods.values())),
                              # the first: from the run's start (prefill), the others: switches between lengths
                              "run_start_gaps_ms": {k: [round(g, 3) for g in v] for k, v in gaps.items()},
                              "after_last_launch_ms": round(tail_ms, 3),
                              "choices": {f"{k} ({why})": n - chosen_before[why, k]
                                          for (why, k), n in sorted(policy.chosen.items()) if n > chosen_before[why, k]}}
    return result


def _medians(samples: dict[str, list[float]]) -> dict[str, list]:
    return {key: [len(v), round(sorted(v)[len(v) // 2], 3)] for key, v in sorted(samples.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepinfer-tiny-v4.1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-graphs", default=None, help='the engine option; "padded-eager" overlaps on a CPU')
    parser.add_argument("--pattern", default="8,4", help="decisions of the longest, then of none, repeated")
    parser.add_argument("--modes", nargs="+", choices=sorted(FORCED), default=list(FORCED))
    args = parser.parse_args()
    prompts = [f"Item {i}: the story of" for i in range(args.batch_size)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    engine = {"dtype": args.dtype} | ({"cuda_graphs": args.cuda_graphs} if args.cuda_graphs else {})
    without = LLM(args.model, **engine)
    plain = _run(without, prompts, params, args.repeats)
    results = {"without_drafts": {"tok_s": plain, "ms_a_token": round(len(prompts) / plain * 1e3, 3),
                                  "start": _start_ms(without, prompts, args.repeats)}}
    for name, forced in [(m, FORCED[m]) for m in args.modes]:
        results[name] = _forced(args, engine, prompts, params, forced)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
