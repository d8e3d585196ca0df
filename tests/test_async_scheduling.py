"""Asynchronous scheduling (DEEPINFER_ASYNC_SCHEDULING, on by default) gives the same outputs as waiting for every
step's tokens: across batching, chunked prefill, preemption, stop strings and stop tokens found a step late, n > 1
seeded sampling and logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams, envs
from deepinfer.runtime.scheduled import ScheduledBatch

V41_FIXTURE = Path(__file__).parent / "fixtures" / "v41_tiny"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):", "x = [",
           "# compute the sum of squares of a list of numbers\n" * 3]
ENGINE_ARGS = [
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill"),
    pytest.param({"num_cache_tokens": 256, "block_size": 16, "enable_prefix_caching": False}, id="preempted"),
]


def _llm(checkpoint, monkeypatch, asynchronous: bool, engine_args, engram_tables: str = "auto") -> LLM:
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "1" if asynchronous else "0")
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", engram_tables)
    envs.reload()
    return LLM(str(checkpoint), dtype="float32", **engine_args)


def _outputs(llm, params):
    """Tokens, text and finish reasons (compared exactly), then the logprobs: the overlapping engine learns of a
    finished request a step late and runs it once more, so the other rows of that step go through GEMMs of another
    row count, which may differ in the last float bit (not batch-invariant mode)."""
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs]
    logprobs = [c.cumulative_logprob for o in outputs for c in o.outputs if c.cumulative_logprob is not None]
    logprobs += [lp.logprob for o in outputs for c in o.outputs for step in (c.logprobs or []) for lp in step.values()]
    return exact, logprobs


def _assert_same(ours, theirs):
    assert ours[0] == theirs[0]
    assert ours[1] == pytest.approx(theirs[1], abs=1e-5)


def _params(reference_llm) -> list[SamplingParams]:
    """Stop strings and stop tokens the outputs really contain, so they end requests mid-generation."""
    greedy = reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    first, second = greedy[0].outputs[0], greedy[1].outputs[0]
    return [
        SamplingParams(temperature=0, max_tokens=24, stop=[first.text[4:7]], logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[second.token_ids[5]], ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, n=2, seq_seed=7, max_tokens=17),
    ]


@pytest.mark.parametrize("engine_args", ENGINE_ARGS)
def test_outputs_are_the_same_with_and_without_overlap(tiny_v4_checkpoint, monkeypatch, engine_args):
    waiting = _llm(tiny_v4_checkpoint, monkeypatch, False, engine_args)
    overlapped = _llm(tiny_v4_checkpoint, monkeypatch, True, engine_args)
    for params in _params(waiting):
        _assert_same(_outputs(overlapped, params), _outputs(waiting, params))
    if "num_cache_tokens" in engine_args:
        assert overlapped.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(("engine_args", "tables"), [
    pytest.param({}, "device", id="batched-device"),
    pytest.param(ENGINE_ARGS[2].values[0], "device", id="preempted-device"),
    pytest.param({}, "host", id="batched-host"),
])
def test_v41_engram_overlaps_with_the_same_outputs(monkeypatch, engine_args, tables):
    """Engram tables on the device: each step hashes its own (in-flight) tokens, so nothing waits for the previous
    step's tokens. On the host: each step waits for the previous step's token values only, and resolves its
    outputs while the device runs. Both against waiting for every step with the host's hashing and gathers."""
    waiting = _llm(V41_FIXTURE, monkeypatch, False, engine_args, "host")
    overlapped = _llm(V41_FIXTURE, monkeypatch, True, engine_args, tables)
    assert overlapped.engine.model.needs_host_tokens == (tables == "host")
    assert overlapped.engine.runner.needs_host_tokens(ScheduledBatch()) == (tables == "host")
    for params in _params(waiting):
        _assert_same(_outputs(overlapped, params), _outputs(waiting, params))


@pytest.mark.parametrize("which", ["v4", "v4.1"])
def test_a_step_is_left_in_flight_only_when_overlapping(which, tiny_v4_checkpoint, monkeypatch):
    checkpoint = tiny_v4_checkpoint if which == "v4" else V41_FIXTURE
    for asynchronous in (False, True):
        llm = _llm(checkpoint, monkeypatch, asynchronous, {})
        llm.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        llm.engine.step()
        assert llm.engine.steps.in_flight is asynchronous
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert not llm.engine.steps.in_flight


def test_penalties_wait_for_the_previous_tokens(tiny_v4_checkpoint, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5)
    waiting = _outputs(_llm(tiny_v4_checkpoint, monkeypatch, False, {}), params)
    _assert_same(_outputs(_llm(tiny_v4_checkpoint, monkeypatch, True, {}), params), waiting)


def test_a_request_preempted_while_its_last_token_is_in_flight_finishes_cleanly(tiny_v4_checkpoint, monkeypatch):
    """Its last token, resolved while it waits in the queue, ends it there; the other request runs on."""
    llm = _llm(tiny_v4_checkpoint, monkeypatch, True, {})
    engine = llm.engine
    done = llm.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    other = llm.submit([9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    engine.step()  # prefill both; their first tokens are in flight
    engine.step()  # second tokens launched, first ones resolved
    assert done.token_ids[-1] == -1  # its last token is still on the device
    engine.scheduler.running.remove(done)
    engine.scheduler._preempt(done)  # as the scheduler would under memory pressure
    engine.scheduler.limits.max_num_seqs = 1  # keeps it queued
    while engine.has_unfinished():
        engine.step()
    assert done.finished and done.finish_reason == "length" and len(done.output_token_ids) == 2
    assert -1 not in done.token_ids and other.finished and len(other.output_token_ids) == 5
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_no_step_is_spent_past_max_tokens(tiny_v4_checkpoint, monkeypatch):
    steps = []
    for asynchronous in (False, True):
        llm = _llm(tiny_v4_checkpoint, monkeypatch, asynchronous, {})
        llm.engine.step_metrics.reset()
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
        steps.append(llm.engine.step_metrics.steps)
    assert steps[0] == steps[1]
