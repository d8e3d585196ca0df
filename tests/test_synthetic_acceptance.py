"""Synthetic acceptance (benchmarks only, ``EngineConfig.synthetic_acceptance_length``): drafts are drafted and
verified as always, but each step's accepted count is drawn for a requested mean acceptance length
(``engine/speculation.py``), in the synchronous and the overlapped steps alike."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.speculation import drafts_in_accepted_rows, synthetic_accepted, synthetic_rate
from deepinfer.plugins.manager import registered

mtp = pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed (build.sh installs it)")

PROMPTS = [f"def f{i}(n):" for i in range(8)]


@pytest.fixture(autouse=True)
def _no_varlen_from_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN", raising=False)
    envs.reload()
    yield
    envs.reload()


def _dspark(**engine_args) -> LLM:
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        return LLM("deepinfer-tiny-v4.1", dtype="float32", num_speculative_tokens=3, max_num_seqs=len(PROMPTS),
                   **{"enable_mtp_varlen": False, **engine_args})


@pytest.mark.parametrize("length, drafts", [(1.5, 3), (2.8, 3), (2.0, 5), (3.5, 5), (1.0, 4), (5.0, 4)])
def test_the_rate_solves_the_geometric_sum(length, drafts):
    p = synthetic_rate(length, drafts)
    assert 0 <= p <= 1
    assert sum(p ** i for i in range(drafts + 1)) == pytest.approx(length, abs=1e-9)
    if length in (1.0, drafts + 1):  # the ends exactly: never (always) accept
        assert p == (0.0 if length == 1 else 1.0)


def test_draws_have_the_requested_mean_and_depend_only_on_request_and_position():
    n, k = 200_000, 3
    keys, positions = torch.arange(n) * 7919, torch.arange(n) % 977
    for length in (1.5, 2.0, 2.8, 3.5):
        counts = synthetic_accepted(keys, positions, torch.full((n,), k), synthetic_rate(length, k), k)
        assert abs(1 + counts.double().mean().item() - length) < 0.01, length
    rate = synthetic_rate(2.8, k)
    counts = synthetic_accepted(keys[:64], positions[:64], torch.full((64,), k), rate, k)
    limits = torch.arange(64) % (k + 1)
    assert torch.equal(synthetic_accepted(keys[:64], positions[:64], limits, rate, k), torch.minimum(counts, limits))
    # a request's draw is the same alone as in any batch (the overlapped steps pad theirs)
    alone = [synthetic_accepted(keys[i:i + 1], positions[i:i + 1], torch.tensor([k]), rate, k).item()
             for i in range(0, 64, 9)]
    assert alone == counts[::9].tolist()


def test_accepted_rows_emit_the_drafts_then_the_target_token():
    sampled = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = drafts_in_accepted_rows(sampled, drafts, torch.tensor([2, 0]))
    assert out.tolist() == [[1, 2, 12, 13], [20, 21, 22, 23]]


@pytest.mark.parametrize("length", [0.5, 4.5, float("nan"), True, "2"])
def test_a_length_out_of_bounds_is_a_value_error_naming_it(length):
    with pytest.raises(ValueError, match=r"synthetic_acceptance_length must be a number in \[1, 4\]") as error:
        EngineConfig(num_speculative_tokens=3, synthetic_acceptance_length=length)
    assert repr(length) in str(error.value)


def test_without_a_drafter_it_is_an_error():
    with pytest.raises(ValueError, match="synthetic_acceptance_length=2.0 needs speculative decoding"):
        LLM("deepinfer-tiny-v4.1", dtype="float32", synthetic_acceptance_length=2.0)


@pytest.mark.parametrize("length", [1.5, 2.8])
def test_measured_mean_acceptance_length_is_the_requested_one(length, caplog):
    """The embedded model's DSpark drafts, verified at fixed length, accepted at random. The draws are a hash of
    each request's id and position, so this run draws the same counts every time: 219 draws measuring 1.402 for
    1.5 and 112 measuring 2.759 for 2.8. At these sizes the standard error is about 0.05 and 0.12, so 0.1 is one
    to two of them: this checks the wiring in the engine, and the statistics are the test above's, over 200,000
    draws. Requests' last steps verify fewer drafts, which pulls the mean slightly below ``length`` too."""
    with caplog.at_level(logging.WARNING):
        llm = _dspark(synthetic_acceptance_length=length)
    warnings = [r for r in caplog.records if "synthetic_acceptance_length" in r.getMessage()]
    assert len(warnings) == 1 and "NOT the target model's" in warnings[0].getMessage()
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)
    stats = llm.engine.speculator.stats
    assert stats.num_drafts >= 100
    assert abs(1 + stats.num_accepted_tokens / stats.num_drafts - length) < 0.1


@pytest.mark.parametrize("policy", ["floor", "measured"])
def test_confidence_scheduling_cuts_no_draft_under_synthetic_acceptance(policy):
    """Draws ignore the drafts, so their confidences cut none: with the load-based floor every draft is verified and
    the measured mean is the requested one (cut by the embedded drafter's confidences, 154 drafts measured 1.99
    against 2.8), and the measured policy books the drawn acceptance, not the cuts."""
    llm = _dspark(synthetic_acceptance_length=2.8, enable_mtp_varlen=True, speculation_policy=policy)
    speculator = llm.engine.speculator
    assert speculator.floor(1) is None and speculator.floor(len(PROMPTS)) is None
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = speculator.stats
    assert stats.num_drafts >= 40
    if policy == "floor":
        assert abs(1 + stats.num_accepted_tokens / stats.num_drafts - 2.8) < 0.15
    else:
        rate = synthetic_rate(2.8, 3)
        assert abs(speculator.policy.acceptance[0] - rate) < 0.15


def test_overlapped_steps_draw_on_the_device_what_synchronous_steps_draw():
    """Padded verification steps (as CUDA graphs replay them; eagerly on a CPU) draw the counts in their device
    tail, from the same keys and positions as the host: the same tokens, drafts and acceptance."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = PROMPTS[:4]
    runs = []
    for engine_args in ({}, {"cuda_graphs": "padded-eager"}):
        llm = _dspark(synthetic_acceptance_length=2.5, **engine_args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.speculator.stats
        runs.append(([o.outputs[0].token_ids for o in outputs],
                     (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)))
    assert runs[0] == runs[1]
    assert llm.engine.overlap.launches["following"] > 0


def test_bench_speculative_reports_each_synthetic_length_on_dummy_weights(tmp_path):
    """``--synthetic-acceptance-length``: beside the run without drafts, one fixed-length run per L, on random
    weights (draft stages included), each with its tok/s, speed-up, measured acceptance and step split."""
    import json

    from deepinfer.cli import main

    out = tmp_path / "speculative.json"
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        main(["bench", "speculative", "--model", "deepinfer-tiny-v4.1", "--batch-sizes", "2", "--output-len", "8",
              "--load-format", "dummy", "--synthetic-acceptance-length", "1.5", "3", "--output-json", str(out)])
    result = json.loads(out.read_text())["batch_2"]
    assert set(result) == {"without_drafts", "synthetic_1.5", "synthetic_3", "speedup"}
    assert set(result["speedup"]) == {"synthetic_1.5", "synthetic_3"}
    for name, length in (("synthetic_1.5", 1.5), ("synthetic_3", 3.0)):
        run = result[name]
        assert run["requested_acceptance_length"] == length and run["drafts"] > 0
        assert run["mean_acceptance_length"] == 1 + run["accepted_tokens"] / run["drafts"]
        assert run["per_step_ms"]["draft"] > 0 and result["speedup"][name] > 0
    assert result["without_drafts"]["per_step_ms"]["draft"] == 0


def test_bench_speculative_frees_each_engine_before_the_next_loads(monkeypatch):
    """Each run's engine is garbage when the bench releases device memory (after the run returns): released from
    inside the run, a run with drafts still held its engine and the next V4.1 engine ran out of memory beside it."""
    import gc
    import weakref

    from deepinfer.bench import speculative, throughput
    from deepinfer.cli import main

    models, alive_at_release = [], []
    build = throughput.build_llm

    def recording_build(*args, **kwargs):
        llm = build(*args, **kwargs)
        models.append(weakref.ref(llm.engine.model))
        return llm

    def recording_release():
        gc.collect()
        alive_at_release.append(models[-1]() is not None)

    monkeypatch.setattr(speculative, "build_llm", recording_build)
    monkeypatch.setattr(throughput, "_release", recording_release)
    monkeypatch.setattr(speculative, "_release", recording_release, raising=False)  # were it imported by name
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        main(["bench", "speculative", "--model", "deepinfer-tiny-v4.1", "--batch-sizes", "1", "--output-len", "4",
              "--load-format", "dummy", "--synthetic-acceptance-length", "2"])
    assert alive_at_release == [False, False]  # without drafts, then with them


def test_bench_speculative_runs_each_mode_asked_for_at_each_synthetic_length(tmp_path):
    """``--modes`` with synthetic acceptance: the measured policy runs beside fixed length at each L, reporting its
    choices of draft length, so its effect is measured on the weights a real drafter cannot reach (dummy ones)."""
    import json

    from deepinfer.cli import main

    out = tmp_path / "speculative.json"
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        main(["bench", "speculative", "--model", "deepinfer-tiny-v4.1", "--batch-sizes", "2", "--output-len", "8",
              "--load-format", "dummy", "--synthetic-acceptance-length", "2", "--modes", "fixed_length",
              "measured_policy", "--output-json", str(out)])
    result = json.loads(out.read_text())["batch_2"]
    assert set(result["speedup"]) == {"synthetic_2", "synthetic_2_measured_policy"}
    policy = result["synthetic_2_measured_policy"]
    assert policy["requested_acceptance_length"] == 2.0 and sum(policy["policy_choices"].values()) > 0
    assert policy["policy_costs_ms"] and all(ms > 0 for ms in policy["policy_costs_ms"].values())
    recent = policy["policy_recent_ms"]  # the samples each cost is the median of
    assert recent.keys() == policy["policy_costs_ms"].keys()
    assert all(sorted(v)[(len(v) - 1) // 2] <= policy["policy_costs_ms"][key] <= sorted(v)[len(v) // 2]
               for key, v in recent.items())
    assert len(policy["policy_acceptance"]) == 5
    assert policy["warmups"] == 1 and policy["graph_captures"] == 0  # no graphs on a CPU: one warm-up suffices
    assert "policy_choices" not in result["synthetic_2"]


def test_seeded_requests_draw_the_same_counts_in_every_run():
    """A seeded request's draws follow its seed, not its id: a benchmark's warm-up and its timed run (new request
    ids) accept the same drafts at the same steps, so the timed run meets only batch sizes the warm-up met (and
    whose CUDA graphs it captured). Unseeded requests keep drawing by id."""
    llm = _dspark(synthetic_acceptance_length=2.5)
    stats = llm.engine.speculator.stats
    seeded = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, seq_seed=i) for i in range(len(PROMPTS))]
    counts = []
    for _ in range(2):
        before = (stats.num_drafts, stats.num_accepted_tokens)
        outputs = llm.generate(PROMPTS, seeded, use_tqdm=False)
        counts.append(((stats.num_drafts - before[0], stats.num_accepted_tokens - before[1]),
                       [o.metrics.accepted_per_position for o in outputs]))
    assert counts[0] == counts[1]
    assert counts[0][0][0] > 0
