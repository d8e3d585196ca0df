"""Speculative steps that overlap the host (``engine/overlapped_speculation.py``): acceptance and drafting stay on the
device and the next verification step is launched before the host has the previous one's result, its positions,
tokens, Engram history and sampling noise positions corrected on the device. Outputs must be those of decoding
without drafts, and the acceptance counters those of the synchronous verification.

On a CPU the padded verification steps run eagerly (``DecodeGraphs(capture=False)``), which runs the same code.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine import speculation
from deepinfer.plugins.interfaces import Draft
from deepinfer.plugins.manager import registered
from deepinfer.testing.oracle_drafts import (GREEDY, PROMPTS, DrafterPlugin, OracleDrafter, assert_same,
                                             WatchingPlugin, continuations, generate_with, reference_accepted,
                                             reference_verified_length)


class DeviceOracleDrafter(OracleDrafter):
    """The oracle, answering on the device too, from a table of each request's reference continuation kept on the
    device (so a CUDA graph can hold its pass)."""

    def __init__(self, reference, wrong_at=None, length=5, slots=32, longest=128):
        super().__init__(reference, wrong_at, length=length)
        device = "cuda" if torch.cuda.is_available() else "cpu"  # where the engine runs
        self.table = torch.zeros(slots, longest + length, dtype=torch.int64, device=device)
        self.prompt_lengths = torch.zeros(slots, dtype=torch.int64, device=device)
        self.slot_of: dict[int, tuple[object, int]] = {}  # id(request) -> (request, slot): ids are reused
        self.assigned = 0

    def device_slots(self, requests):
        for r in requests:
            entry = self.slot_of.get(id(r))
            if entry is None or entry[0] is not r:
                slot, self.assigned = self.assigned, self.assigned + 1
                self.slot_of[id(r)] = (r, slot)
                continuation = self.reference[tuple(r.prompt_token_ids)]
                self.table[slot, :len(continuation)] = torch.tensor(continuation)
                self.prompt_lengths[slot] = len(r.prompt_token_ids)
        return [self.slot_of[id(r)][1] for r in requests]

    def propose_on_device(self, slots, positions, rows, kept, sampled, features):
        slots = slots.clamp_min(0)  # padding requests read slot 0: their drafts are ignored
        done = positions + kept - self.prompt_lengths[slots] + 1  # output tokens up to the new last one
        columns = (done.unsqueeze(1) + torch.arange(self.length, device=done.device)).clamp(0, self.table.shape[1] - 1)
        drafts = self.table[slots].gather(1, columns)
        if self.wrong_at is not None:
            drafts[:, self.wrong_at] = (drafts[:, self.wrong_at] + 1) % 64
        return drafts, None


def _overlapped(checkpoint, prompts, params, drafter, max_num_seqs=8, **engine_args):
    """``prompts`` through an engine whose verification steps are padded (as CUDA graphs replay them); returns the
    outputs, the engine, and how many steps were launched first of a run and following another."""
    engine_args.setdefault("dtype", "float32")
    with registered(DrafterPlugin(drafter), "oracle-drafts"):
        llm = LLM(str(checkpoint), max_num_seqs=max_num_seqs, cuda_graphs="padded-eager", **engine_args)
    engine = llm.engine
    return llm.generate(prompts, params, use_tqdm=False), engine, engine.overlap.launches


@pytest.fixture(scope="module")
def greedy_v4(tiny_v4_checkpoint):
    return generate_with(tiny_v4_checkpoint, PROMPTS, GREEDY)[0]


@pytest.mark.parametrize("wrong_at", [None, 0, 1, 2, 3, 4])
def test_greedy_output_and_counters_match_the_synchronous_verification(tiny_v4_checkpoint, greedy_v4, wrong_at):
    """Every draft position forced wrong in turn: the following step's rows start wherever the rejection left the
    request, which the host learns only a step later."""
    outputs, engine, launches = _overlapped(tiny_v4_checkpoint, PROMPTS, GREEDY,
                                            DeviceOracleDrafter(continuations(greedy_v4), wrong_at=wrong_at))
    assert_same(outputs, greedy_v4)
    assert launches["following"] >= 2 and launches["following"] > launches["first"]
    drafter = OracleDrafter(continuations(greedy_v4), wrong_at)
    synchronous, _ = generate_with(tiny_v4_checkpoint, PROMPTS, GREEDY, drafter)
    ours = [(o.metrics.num_drafts, o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) for o in outputs]
    assert ours == [(o.metrics.num_drafts, o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens)
                    for o in synchronous]
    assert engine.speculator.stats.num_drafts == sum(o.metrics.num_drafts for o in outputs) > 0


def test_seeded_sampling_offsets_its_noise_positions_on_the_device(tiny_v4_checkpoint):
    """seq_seed noise is keyed by output position, which a following step only knows on the device. min_tokens
    holds the requests in synchronous steps first (its blocking is decided on the host)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seq_seed=7, ignore_eos=True, min_tokens=3)
    expected, _ = generate_with(tiny_v4_checkpoint, PROMPTS, params)
    for wrong_at in (None, 1):
        outputs, _, launches = _overlapped(tiny_v4_checkpoint, PROMPTS, params,
                                           DeviceOracleDrafter(continuations(expected), wrong_at))
        assert_same(outputs, expected)
        assert launches["following"] > 0


def test_v41_engram_history_follows_on_the_device():
    """Engram hashes each row's preceding tokens: a following step takes them from the previous step's rows at the
    accepted count (test_dspark.py runs the real DSpark drafter's device path)."""
    prompts = ["def fibonacci(n):", "import os\n", '"""Return the']
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    exact = dict(quantization="none")
    expected, _ = generate_with("deepinfer-tiny-v4.1", prompts, params, **exact)
    outputs, _, launches = _overlapped("deepinfer-tiny-v4.1", prompts, params,
                                       DeviceOracleDrafter(continuations(expected), wrong_at=2), **exact)
    assert_same(outputs, expected)
    assert launches["following"] > launches["first"]


def test_stops_inside_a_block_and_limits_while_a_step_is_in_flight(tiny_v4_checkpoint, greedy_v4):
    """A request that stops (stop string, stop token, max_tokens, max_model_len) has a following step in flight
    already: its rows there are dropped and nothing after the stop is emitted."""
    first, second = greedy_v4[0].outputs[0], greedy_v4[1].outputs[0]
    cases = [SamplingParams(temperature=0, max_tokens=16, stop=[first.text[5:8]]),
             SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[second.token_ids[6]], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    for params in cases:
        expected, _ = generate_with(tiny_v4_checkpoint, PROMPTS, params)
        outputs, _, launches = _overlapped(tiny_v4_checkpoint, PROMPTS, params,
                                           DeviceOracleDrafter(continuations(greedy_v4), length=50))
        assert_same(outputs, expected)
        assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outputs] == [
            (o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in expected]
        assert launches["following"] > 0
    short, _, _ = _overlapped(tiny_v4_checkpoint, PROMPTS[:1], GREEDY, DeviceOracleDrafter(continuations(greedy_v4)),
                              max_model_len=12)
    assert len(short[0].prompt_token_ids) + len(short[0].outputs[0].token_ids) == 12


def test_admissions_and_preemption_fall_back_to_synchronous_steps(tiny_v4_checkpoint):
    """More requests than sequence slots (each finished request admits a waiting one) and a cache small enough to
    preempt: the run drops to synchronous steps where it must and resumes overlapping after."""
    prompts = PROMPTS + ["x = [", "# compute the sum of squares of a list of numbers\n" * 3, PROMPTS[0]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine_args = dict(num_cache_tokens=160, block_size=16, enable_prefix_caching=True)
    expected, _ = generate_with(tiny_v4_checkpoint, prompts, params, max_num_seqs=2, **engine_args)
    outputs, engine, launches = _overlapped(tiny_v4_checkpoint, prompts, params,
                                            DeviceOracleDrafter(continuations(expected), wrong_at=3), max_num_seqs=2,
                                            **engine_args)
    assert_same(outputs, expected)
    assert launches["following"] > 0 and launches["first"] >= 3
    assert engine.overlap.inflight is None and not engine.scheduler.has_work()


def test_prompts_no_longer_than_a_verification_step_are_prefilled_not_verified(tiny_v4_checkpoint):
    """A prompt of up to 1 + max_drafts tokens fits a verification step's rows, but its prefill samples its last
    row only: replayed as a verification step, its first token came from its first row's logits (2026-12-06: a
    wrong first token at batch 1, a size mismatch in the sampler at batch 2)."""
    prompts = [{"prompt_token_ids": [100, 200, 300]}, {"prompt_token_ids": [7, 8, 9, 10, 11, 12]},
               {"prompt_token_ids": [42]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected, _ = generate_with(tiny_v4_checkpoint, prompts, params)
    for batch in ([0], [1, 2], [0, 1, 2]):
        chosen = [prompts[i] for i in batch]
        outputs, _, _ = _overlapped(tiny_v4_checkpoint, chosen, params, DeviceOracleDrafter(continuations(expected)))
        assert_same(outputs, [expected[i] for i in batch])


def test_acceptance_and_lengths_on_the_device_match_the_host():
    g = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 3, (64, 5), generator=g)
    sampled = torch.randint(0, 3, (64, 6), generator=g)
    limits = torch.randint(0, 6, (64,), generator=g)
    device = speculation.accepted_counts(drafts, sampled, limits).tolist()
    assert device == [reference_accepted(d[:n], s) for d, s, n in
                      zip(drafts.tolist(), sampled.tolist(), limits.tolist())]
    assert max(device) >= 2  # the check reaches past the first position
    confidence = torch.rand(64, 5, generator=g) ** 0.3
    for floor in (None, 0.1, 0.5):
        lengths = speculation.verified_lengths(torch.full((64,), 4), confidence, floor).tolist()
        assert lengths == [reference_verified_length(Draft(d, c), 4, floor)
                           for d, c in zip(drafts.tolist(), confidence.tolist())]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seq_seed=5,
                                                           ignore_eos=True, logprobs=2)], ids=["greedy", "seeded"])
def test_overlapped_steps_replay_cuda_graphs_as_eager_steps_run(tiny_v4_checkpoint, greedy_v4, params):
    """On a GPU with the NVIDIA plugin: verification steps captured with their tails (sampling, here also top-p and
    seeded noise, acceptance, drafting), corrected on the device and replayed while the host resolves the step
    before give the eager synchronous steps' tokens, logprobs and counters."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed
    nvidia = pytest.importorskip("deepinfer_nvidia.plugin")
    drafter = DeviceOracleDrafter(continuations(greedy_v4), wrong_at=2)
    with registered(nvidia, "nvidia"), registered(DrafterPlugin(drafter), "oracle-drafts"):
        eager = LLM(str(tiny_v4_checkpoint), dtype="float32", enforce_eager=True)
        expected = eager.generate(PROMPTS, params, use_tqdm=False)
        llm = LLM(str(tiny_v4_checkpoint), dtype="float32")
        replayed = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.engine
    assert engine.graphs is not None and engine.graphs.graphs and engine.overlap.launches["following"] > 0
    assert_same(replayed, expected)
    assert eager.engine.overlap.launches["following"] == 0  # no graphs, no overlap
    ours, theirs = engine.speculator.stats, eager.engine.speculator.stats
    assert (ours.num_drafts, ours.num_draft_tokens, ours.num_accepted_tokens) == (
        theirs.num_drafts, theirs.num_draft_tokens, theirs.num_accepted_tokens)


def test_mtp_drafts_on_the_device_as_on_the_host(tmp_path_factory, monkeypatch):
    """The classic MTP drafter's device path (window rows of the kept positions, the streams at the last, the
    chain from the new last token) proposes at every anchor what its host path proposes there."""
    from deepinfer.testing.tiny_v4 import add_mtp_layer, build_tiny_v4

    checkpoint = add_mtp_layer(build_tiny_v4(tmp_path_factory.mktemp("tiny_v4_mtp")))
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    envs.reload()
    # the second prompt outgrows the tiny model's window: the pool's rows wrap around
    prompts = [[5, 9, 13, 20, 7], [(i * 7) % 250 + 3 for i in range(70)]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for overlapped in (False, True):
        proposed = {}

        def on_host(host, requests, computed, features, proposed=proposed):
            drafts = host(requests, computed, features)
            proposed.update({(r.prompt_token_ids[0], len(r.token_ids)): d.token_ids for r, d in zip(requests, drafts)})
            return drafts

        def on_device(device, slots, positions, rows, kept, sampled, features, proposed=proposed):
            tokens, confidence = device(slots, positions, rows, kept, sampled, features)
            requests = {slot: r for r, slot in device.__self__.pool._slots.values()}
            ends = (positions + kept + 1).tolist()
            proposed.update({(requests[slot].prompt_token_ids[0], end): t for slot, end, t in
                             zip(slots.tolist(), ends, tokens.tolist()) if slot >= 0})
            return tokens, confidence

        watching = WatchingPlugin(importlib.import_module("deepinfer_mtp.plugin"), propose=on_host,
                                  propose_on_device=on_device)
        with registered(watching, "mtp"):
            llm = LLM(str(checkpoint), dtype="float32", **({"cuda_graphs": "padded-eager"} if overlapped else {}))
        engine = llm.engine
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outputs], proposed, engine.overlap.launches["following"]))
    (tokens, on_host, _), (overlapped_tokens, mixed, following) = runs
    assert overlapped_tokens == tokens and following > 0
    # the device also drafts for requests without room left (their drafts are cut to none): compare the others
    assert {anchor: mixed.get(anchor) for anchor in on_host} == on_host and len(on_host) >= 16
