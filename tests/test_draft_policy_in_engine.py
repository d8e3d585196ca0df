"""The measured draft policy (``engine/draft_policy.py``) in the engine on the embedded model: outputs stay those
of decoding without drafts, the overlapped steps' clock books a run's steady periods, the policy's plain steps
sample and store inside their graph. Its decisions on synthetic costs: tests/test_draft_policy.py."""

from __future__ import annotations

import pytest

from deepinfer.engine import draft_policy


# -- in the engine: outputs stay those of decoding without drafts -------------------------------------------------
PROMPTS = ["def fibonacci(n):", "import os\n", '"""Return the']
PARAMS = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.8, top_p=0.95, seq_seed=7)}


def _embedded(**engine_args):
    """The embedded model in fp32 with dequantized weights: exact outputs need arithmetic that does not depend on
    a step's row count (tests/test_dspark.py)."""
    import importlib

    from deepinfer import LLM
    from deepinfer.plugins.manager import registered

    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM("deepinfer-tiny-v4.1", dtype="float32", quantization="none", **engine_args)


@pytest.fixture(scope="module")
def plain_outputs():
    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    from deepinfer import SamplingParams

    llm = _embedded(enable_mtp_varlen=None)
    return {name: [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True, **p), use_tqdm=False)] for name, p in PARAMS.items()}


@pytest.mark.parametrize("choices", ["measured", "alternating"])
@pytest.mark.parametrize("steps", ["synchronous", "overlapped"])
def test_outputs_with_the_policy_are_those_without_drafts(plain_outputs, steps, choices, monkeypatch):
    """The embedded model's real drafts under the measured policy (its own decisions; and forced to alternate
    between plain steps and drafts, so every switch is crossed): greedy and seq_seed outputs identical to decoding
    without drafts, in the synchronous steps and in the overlapped ones (padded, as CUDA graphs replay them)."""
    from deepinfer import SamplingParams

    if choices == "alternating":  # plain, longest, plain, a middle length...: the decisions that switch paths
        real_choose = draft_policy.choose

        def alternate(policy, requests, lengths):
            real_choose(policy, requests, lengths)  # keeps its bookkeeping
            decision = sum(policy.decisions.values())
            return (0 if decision % 2 else lengths[(decision // 2) % len(lengths)]), "best"

        monkeypatch.setattr(draft_policy, "choose", alternate)
    llm = _embedded(enable_mtp_varlen=True, speculation_policy="measured", num_speculative_tokens=3,
                    **({"cuda_graphs": "padded-eager"} if steps == "overlapped" else {}))
    speculator = llm.engine.speculator
    assert speculator.policy is not None
    assert speculator.policy_choices == ((0, 3) if steps == "overlapped" else (0, 1, 2, 3))
    for name, p in PARAMS.items():
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True, **p), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == plain_outputs[name], name
    policy = speculator.policy
    timed = {k for (_, k) in policy.costs}
    # measured: plain steps and the longest drafts were both run and timed. Alternating, no run of plain steps
    # is long enough to yield a steady period (the clock books a run's periods from its third step's: the next
    # test), and neither is a run of overlapped verification steps; synchronous verification steps book their own
    # time each
    if choices == "measured":
        assert {0, 3} <= timed
    else:
        assert timed == (set() if steps == "overlapped" else {1, 2, 3})
    assert speculator.stats.num_drafts > 0 and speculator.stats.num_accepted_tokens > 0  # real acceptance
    if steps == "overlapped":  # alternating, a run of verification steps is one step long: none follows another
        assert llm.engine.overlap.launches["first" if choices == "alternating" else "following"] > 0
    if choices == "measured":  # plain runs: plain steps launched before the one in flight was resolved
        assert llm.engine.overlap.launches["plain"] > 0


def test_the_floor_policy_keeps_the_load_based_floor(monkeypatch):
    """speculation_policy='floor' is confidence scheduling as before the measured policy: no policy state, the
    load-based survival floor."""
    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    from deepinfer.engine.speculation import MIN_SURVIVAL, survival_floor

    floor = _embedded(enable_mtp_varlen=True, speculation_policy="floor").engine.speculator
    assert floor.policy is None and floor.floor(8) == survival_floor(8, floor.max_drafts, floor.max_num_batched_tokens)
    measured = _embedded(enable_mtp_varlen=True).engine.speculator  # the default
    assert measured.policy is not None and measured.floor(8) == MIN_SURVIVAL
    fixed = _embedded(enable_mtp_varlen=False).engine.speculator  # fixed length: no policy, no floor
    assert fixed.policy is None and fixed.floor(8) is None


def test_overlapped_steps_book_only_a_run_s_steady_periods(monkeypatch):
    """The overlapped steps' clock books a step launch to launch inside its run: a run of n steps of one length
    books n - 3 (its first period is the host's launching alone, its second the first step's device time and its
    resolving in series, its last step's time a whole latency), and the
    warm-up repeats a length until it is booked, so both plain steps and drafts get steady samples."""
    from deepinfer import SamplingParams
    from deepinfer.engine import overlapped_speculation
    from deepinfer.engine.run_clock import RunClock

    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")
    llm = _embedded(enable_mtp_varlen=True, speculation_policy="measured", num_speculative_tokens=3,
                    cuda_graphs="padded-eager")
    overlap = llm.engine.overlap
    # (drafts, began its run) per launch; drafts per booking of this clock (a synchronous step between runs, where
    # the drafter cut every draft, books its own time: SpeculativeSteps' rule)
    launches, booked, booking = [], [], []
    record = draft_policy.record_cost

    class Noting(RunClock):
        __slots__ = ()

        def note(self, requests, drafts, first):
            launches.append((drafts, first))
            super().note(requests, drafts, first)

        def book(self):
            booking.append(True)
            super().book()
            booking.pop()

    def recording(policy, requests, k, seconds):
        if booking:
            booked.append(k)
        record(policy, requests, k, seconds)

    overlap.clock = Noting(overlap.clock.policy)
    monkeypatch.setattr(overlapped_speculation.draft_policy, "record_cost", recording)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=48, ignore_eos=True, temperature=0), use_tqdm=False)
    runs = []  # [drafts, steps] per run, in order
    for drafts, first in launches:
        if first or not runs:
            runs.append([drafts, 0])
        assert runs[-1][0] == drafts  # a run's steps are all of one length
        runs[-1][1] += 1
    assert sorted(booked) == sorted(k for k, n in runs for _ in range(n - 3)), (runs, booked)
    assert {0, 3} <= set(booked)  # both lengths were timed in steady runs
    # one request, nothing arriving: each run of drafts the policy began (warm-up, probe) lasted until it yielded a
    # period (a plain run may be one step: the drafter cut every draft the policy chose)
    assert all(n >= 4 for k, n in runs[:-1] if k), runs


def test_plain_steps_sample_and_store_inside_their_graph(plain_outputs, monkeypatch):
    """The policy's plain runs replay one graph a step: sampling and the drafter's store are its tail. Forced
    through runs of 8 plain steps and 4 of drafts, the outputs are those without drafts and the drafts (read from
    what the plain steps stored) are the ones the eager store gives; a request with a penalty samples on the host,
    so its plain steps store eagerly."""
    from deepinfer import SamplingParams
    from deepinfer.engine.plain_store import PlainStepStore

    real_choose = draft_policy.choose

    def runs_of_8_plain_and_4_drafts(policy, requests, lengths):
        real_choose(policy, requests, lengths)
        return (0 if sum(policy.decisions.values()) % 12 < 8 else lengths[-1]), "best"

    monkeypatch.setattr(draft_policy, "choose", runs_of_8_plain_and_4_drafts)
    tails = []
    real_tail = PlainStepStore._run

    def counted(self, *args):
        tails.append(True)
        return real_tail(self, *args)

    monkeypatch.setattr(PlainStepStore, "_run", counted)
    built = []  # a plain run's steps share one tail while its requests stay the same (rebuilt as they change)
    real_build = PlainStepStore._build
    monkeypatch.setattr(PlainStepStore, "_build", lambda self, requests: built.append(len(requests))
                        or real_build(self, requests))
    drafted = {}
    for store in ("tail", "eager"):
        if store == "eager":
            monkeypatch.setattr(PlainStepStore, "tail", lambda self, scheduled: None)
        llm = _embedded(enable_mtp_varlen=True, speculation_policy="measured", num_speculative_tokens=3,
                        cuda_graphs="padded-eager")
        stats = llm.engine.speculator.stats
        for name, p in PARAMS.items():
            outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True, **p), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == plain_outputs[name], (store, name)
        drafted[store] = (stats.num_drafts, stats.num_accepted_tokens)
        assert llm.engine.overlap.launches["plain"] > 0
        assert bool(tails) == (store == "tail"), store  # the eager store ran no tail
        if store == "tail":
            assert 0 < len(built) < len(tails) / 2 and set(built) >= {3}
        tails.clear()
        if store == "tail":
            plain = llm.engine.overlap.launches["plain"]
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
                         use_tqdm=False)
            assert llm.engine.overlap.launches["plain"] > plain and not tails
    assert drafted["tail"] == drafted["eager"] and drafted["tail"][1] > 0
