"""``deepinfer bench speculative``: decode speed with and without speculative decoding, and what was accepted.

Text prompts (drafts are only worth measuring on text a model can predict; random ids would accept nothing):
the built-in Python snippets, or one prompt per line of ``--prompts-file``, cycled to ``--batch-size``. Each
batch size runs on the same prompts, greedy, after a warm-up of each (in the same engine, so the measured policy
starts the timed run with what it learnt; repeated, up to ``MAX_WARMUPS``, while a warm-up still captures CUDA
graphs): without drafts (``enable_mtp_varlen=None``), then with the installed drafter (e.g. features/mtp's
DSpark) verifying every draft (``False``, fixed length), with confidence-scheduled lengths under the load-based
floor (``True``, ``speculation_policy="floor"``) and under the measured policy (``"measured"``,
``engine/draft_policy.py``). Reports decode tokens/s of each, the speed-ups, vLLM's acceptance
counters, whether the runs generated the same tokens, each run's step split (``step_split_ms``: verification
forward, draft passes, sampling and acceptance, host) and, for the measured policy, how often it chose each draft
length (``policy_choices``). One more run, fixed length with ``async_scheduling=False``, is the peer of
speculative steps that overlap the host (``engine/overlapped_speculation.py``): the same verification, each step
waiting for the host. ``--modes`` runs a subset (``without_drafts`` always runs: it is every ratio's peer).

``--synthetic-acceptance-length L [L ...]`` (benchmarks only, ``EngineConfig.synthetic_acceptance_length``) runs,
after the run without drafts, one run per ``L`` and mode of ``--modes`` (default: fixed length) whose drafts are
drafted and verified as always but accepted at random for a mean acceptance length of ``L``: what speculation
would gain with a drafter that good, on any weights (``--load-format dummy`` too). Their tokens are not the model's, so ``same_tokens`` is not reported.
"""

from __future__ import annotations

import argparse
import time

from deepinfer.bench.throughput import _add_common, _synchronize, build_llm, releases_engine
from deepinfer.engine.warm_up import warm_up_server
from deepinfer.runner import cuda_graphs
from deepinfer.runtime import kernel_compiles

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    'class Stack:\n    """A last-in, first-out container."""\n\n    def __init__(self):',
    "for i in range(10):\n    if i % 2 == 0:",
    "def read_lines(path):\n    with open(path) as f:",
    '"""Return the',
    "try:\n    import json\nexcept ImportError:",
    "def __repr__(self):\n        return",
]


# mode -> (enable_mtp_varlen, async_scheduling, speculation_policy); the last is the peer of overlapped speculative
# steps: the same fixed-length verification, each step waiting for the host
MODES = {"without_drafts": (None, True, "measured"), "fixed_length": (False, True, "measured"),
         "confidence_scheduled": (True, True, "floor"), "measured_policy": (True, True, "measured"),
         "fixed_length_synchronous": (False, False, "measured")}


MAX_WARMUPS = 3  # warm-up runs of each timed run at most (one where a warm-up captures no graph)


def seeded_greedy(count: int, max_tokens: int) -> list:
    """Greedy parameters for ``count`` requests of exactly ``max_tokens`` tokens, request ``i`` seeded ``i``: the
    seed leaves greedy tokens alone, but synthetic acceptance then draws the same counts in a warm-up and the timed
    run after it, so the timed run meets no batch size (requests finish at different steps) whose CUDA graph the
    warm-up did not capture (a capture tunes kernels for seconds)."""
    from deepinfer import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, seq_seed=i) for i in range(count)]


def step_split(per_step_ms: dict[str, float]) -> dict[str, float]:
    """``StepMetrics``' phases grouped as speculation's costs: the forward pass (on a CPU, or a verification step
    that waits for the host, its run; overlapped, its launch), the draft passes (with the drafter's store of the
    step's rows), sampling and acceptance (with waiting for the device's result), and the host's own work."""
    ms = per_step_ms
    return {"verification_forward": round(ms["forward"], 3), "draft_passes": round(ms["draft"], 3),
            "sampling_acceptance": round(ms["sample"] + ms["wait"], 3),
            "host": round(ms["schedule"] + ms["prepare"] + ms["outputs"], 3)}


@releases_engine
def _run(args, batch: int, prompts: list[str], varlen: bool | None, asynchronous: bool, policy: str,
         synthetic: float | None = None) -> dict:
    from deepinfer import SamplingParams

    speculative = varlen is not None
    llm = build_llm(args, max_num_seqs=max(batch, 1), enable_mtp_varlen=varlen, async_scheduling=asynchronous,
                    speculation_policy=policy,
                    **({} if synthetic is None else {"synthetic_acceptance_length": synthetic}))
    if speculative and llm.engine.speculator is None:
        raise SystemExit(f"no drafter serves this model with enable_mtp_varlen={varlen} (is features/mtp "
                         "installed?)")
    overlap = llm.engine.overlap
    params = seeded_greedy(len(prompts), args.output_len)
    # warm-up as long as the timed run: kernels are tuned per shape, and shapes follow the context as it grows.
    # Again while a warm-up still captured CUDA graphs: with the measured policy the shapes a run meets follow its
    # timed decisions, and a capture inside the timed run costs seconds (H100, embedded model, batch 32: 4 of them).
    # First the server's warm-up (on a GPU): every graph batch size up to this batch, at each length the policy
    # chooses from, so the sizes a run's end shrinks to are captured (H100, batch 32: a batch-16 probe captured in
    # the timed run, 0.50x)
    warm_up_server(llm, None)
    warmups = 0
    while warmups < MAX_WARMUPS:
        warmups, captured = warmups + 1, cuda_graphs.captures
        llm.generate(prompts, params, use_tqdm=False)
        if cuda_graphs.captures == captured:
            break
    stats = llm.engine.speculator.stats if speculative else None
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) if stats else None
    policy_state = llm.engine.speculator.policy if speculative else None
    chosen_before = policy_state.chosen.copy() if policy_state is not None else None
    overlapped_before = overlap.launches["following"] if overlap is not None else 0
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _synchronize()
    start = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    _synchronize()
    prefill = time.perf_counter() - start
    llm.engine.step_metrics.reset()
    captures, compiles = cuda_graphs.captures, kernel_compiles.count()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _synchronize()
    elapsed = time.perf_counter() - start
    metrics = llm.engine.step_metrics
    result = {"decode_tokens_per_second": batch * (args.output_len - 1) / max(elapsed - prefill, 1e-9),
              "steps": metrics.steps, "warmups": warmups,
              "per_step_ms": {k: round(v, 3) for k, v in metrics.per_step_ms().items()},
              "step_split_ms": step_split(metrics.per_step_ms()),
              "token_ids": [o.outputs[0].token_ids for o in outputs],
              # CUDA graphs captured inside the timed run (seconds each): shapes its warm-up did not meet
              "graph_captures": cuda_graphs.captures - captures,
              "kernel_compiles": kernel_compiles.count() - compiles,  # Triton's, likewise
              # verification steps launched before the host had the previous one's result
              "overlapped_steps": (overlap.launches["following"] - overlapped_before) if overlap is not None else 0}
    if stats is not None:
        drafts, draft_tokens, accepted = (now - then for now, then in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        per_request = [o.metrics.accepted_per_position for o in outputs]
        positions = max(map(len, per_request), default=0)
        result.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                      mean_acceptance_length=1 + accepted / drafts if drafts else None,
                      acceptance_rate_by_position=[
                          sum(p[i] for p in per_request if i < len(p)) / max(drafts, 1) for i in range(positions)])
    if policy_state is not None:  # the timed run's decisions: "k (reason)" -> count
        chosen = policy_state.chosen - chosen_before
        result["policy_choices"] = {f"{k} ({reason})": n for (reason, k), n in sorted(chosen.items(),
                                                                                       key=lambda item: item[0][1])}
        # what the choices rested on at the end: each (batch bucket, length)'s booked cost, the acceptance
        result["policy_costs_ms"] = {f"b{bucket}/k{k}": round(seconds * 1e3, 3)
                                     for (bucket, k), seconds in sorted(policy_state.costs.items())}
        result["policy_recent_ms"] = {f"b{bucket}/k{k}": [round(seconds * 1e3, 3) for seconds in recent]
                                      for (bucket, k), recent in sorted(policy_state.recent.items())}
        result["policy_acceptance"] = [round(a, 3) for a in policy_state.acceptance]
    return result


def run(args, vocab: int) -> dict:
    synthetic = args.synthetic_acceptance_length
    if args.compare_hf or (args.load_format == "dummy" and not synthetic):
        raise SystemExit("bench speculative compares DeepInfer with itself on real weights: --compare-hf does not "
                         "apply, nor --load-format dummy without --synthetic-acceptance-length")
    texts = PROMPTS
    if args.prompts_file:
        with open(args.prompts_file) as f:
            texts = [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    results = {}
    for batch in args.batch_sizes:
        prompts = [texts[i % len(texts)] for i in range(batch)]
        if synthetic:
            results[f"batch_{batch}"] = _synthetic_runs(args, batch, prompts, synthetic)
            continue
        runs = {name: _run(args, batch, prompts, *mode) for name, mode in MODES.items()
                if name == "without_drafts" or args.modes is None or name in args.modes}
        tokens = {name: run.pop("token_ids") for name, run in runs.items()}
        plain = runs["without_drafts"]["decode_tokens_per_second"]
        results[f"batch_{batch}"] = {
            **runs, "same_tokens": all(t == tokens["without_drafts"] for t in tokens.values()),
            # per run: requests whose tokens are those of decoding without drafts
            "same_tokens_requests": {name: sum(a == b for a, b in zip(t, tokens["without_drafts"]))
                                     for name, t in tokens.items() if name != "without_drafts"},
            "speedup": {name: run["decode_tokens_per_second"] / plain for name, run in runs.items()
                        if name != "without_drafts"}}
    return results


def _synthetic_runs(args, batch: int, prompts: list[str], lengths: list[float]) -> dict:
    """Without drafts, then for each requested mean acceptance length one run per mode of ``--modes`` (fixed length
    alone by default) whose drafts are accepted at random: ``synthetic_L`` fixed length, ``synthetic_L_MODE`` the
    others (the measured policy's choice of draft length on these weights, at this acceptance)."""
    runs = {"without_drafts": _run(args, batch, prompts, *MODES["without_drafts"])}
    for length in lengths:
        for mode in args.modes or ["fixed_length"]:
            name = f"synthetic_{length:g}" + ("" if mode == "fixed_length" else f"_{mode}")
            runs[name] = {"requested_acceptance_length": length,
                          **_run(args, batch, prompts, *MODES[mode], synthetic=length)}
    for run in runs.values():
        run.pop("token_ids")
    plain = runs["without_drafts"]["decode_tokens_per_second"]
    return {**runs, "speedup": {name: run["decode_tokens_per_second"] / plain for name, run in runs.items()
                                if name != "without_drafts"}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-file", help="one prompt per line (\\n escapes become newlines)")
    parser.add_argument("--modes", nargs="+", choices=[m for m in MODES if m != "without_drafts"],
                        help="the runs with drafts to time (default: all); the run without drafts always runs")
    parser.add_argument("--synthetic-acceptance-length", type=float, nargs="+", metavar="L",
                        help="benchmarks only: instead of the real runs with drafts, one run per L and mode of --modes "
                             "(default: fixed length) whose drafts are accepted at random for a mean acceptance length "
                             "of L (outputs are not the model's; --load-format dummy allowed)")
    parser.set_defaults(run=run)
