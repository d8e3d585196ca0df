"""The measured draft-length policy (``engine/draft_policy.py``) on synthetic costs and acceptance: its decisions,
its warm-up and probe schedule, and its bookkeeping."""

from __future__ import annotations

import pytest

from deepinfer.engine import draft_policy
from deepinfer.engine.draft_policy import (MIN_PROBE_INTERVAL, PROBE_BUDGET, PROBE_STEPS, WARMUP_SAMPLES, probe_price,
                                           DraftPolicy, batch_bucket, best_length, choose, expected_tokens,
                                           record_acceptance, record_cost, tokens_per_second)


def _measured(max_drafts: int, bucket: int, cost_of, rate: float | list[float]) -> DraftPolicy:
    """A policy past warm-up in ``bucket``: every length timed at ``cost_of(k)`` seconds, acceptance ``rate`` per
    position."""
    policy = DraftPolicy(max_drafts)
    for k in range(max_drafts + 1):
        for _ in range(WARMUP_SAMPLES):
            record_cost(policy, bucket, k, cost_of(k))
    _accepting(policy, rate)
    return policy


def _accepting(policy: DraftPolicy, rate: float) -> None:
    """Each draft accepted with conditional probability ``rate`` (draft ``j`` emitted with ``rate ** (j + 1)``), as
    if measured over many requests."""
    policy.offered = [1000.0] * policy.max_drafts
    policy.emitted = [1000.0 * rate ** (j + 1) for j in range(policy.max_drafts)]
    policy.verified_requests = 1000


# a memory-bound step: drafts nearly free (a verification step of k drafts costs 1 + 0.02 k plain steps)
CHEAP_ROWS = lambda k: 0.010 * (1 + 0.02 * k)  # noqa: E731
# the embedded model on a CPU: verifying 5 drafts costs 1.43x a plain step, and the draft pass 0.4x more
DEAR_ROWS = lambda k: 0.010 * (1 + 0.086 * k + (0.4 if k else 0))  # noqa: E731


def test_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 8, 9, 32, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    with pytest.raises(ValueError, match="at least one request"):
        batch_bucket(0)


def test_expected_tokens_adds_each_position_s_share():
    assert expected_tokens([0.5, 0.25, 0.125], 0) == 1
    assert expected_tokens([0.5, 0.25, 0.125], 2) == pytest.approx(1.75)
    assert expected_tokens([0.5, 0.25, 0.125], 3) == pytest.approx(1.875)


def test_a_position_never_promises_more_than_the_one_before():
    policy = DraftPolicy(3)
    policy.offered, policy.emitted = [100.0, 100.0, 1.0], [40.0, 10.0, 1.0]  # position 2: one lucky request
    assert policy.acceptance == [0.4, 0.1, 0.1]


def test_high_acceptance_and_cheap_rows_draft_the_longest():
    policy = _measured(5, 1, CHEAP_ROWS, 0.8)
    assert best_length(policy, 1, tuple(range(6))) == 5


def test_low_acceptance_falls_back_to_plain_decoding():
    policy = _measured(5, 1, CHEAP_ROWS, 0.01)
    assert best_length(policy, 1, tuple(range(6))) == 0


def test_drafts_that_cost_more_than_they_emit_are_skipped_even_at_fair_acceptance():
    """The embedded model on a CPU: a mean acceptance length of ~1.5 does not pay for a 1.8x dearer step."""
    policy = _measured(5, 32, DEAR_ROWS, 0.35)
    assert best_length(policy, 32, tuple(range(6))) == 0
    # the same acceptance where rows are cheap pays
    assert best_length(_measured(5, 32, CHEAP_ROWS, 0.35), 32, tuple(range(6))) > 0


def test_a_large_batch_shortens_drafts_where_rows_grow_dear():
    """Small batch memory-bound (rows nearly free), large batch compute-bound (each row costs its share): the
    same acceptance picks long drafts at batch 1 and short ones at batch 64."""
    policy = DraftPolicy(5)
    for k in range(6):
        for _ in range(WARMUP_SAMPLES):
            record_cost(policy, 1, k, 0.010 * (1 + 0.02 * k))
            record_cost(policy, 64, k, 0.010 * (1 + 1.0 * k))
    _accepting(policy, 0.7)
    small, large = best_length(policy, 1, tuple(range(6))), best_length(policy, 64, tuple(range(6)))
    assert small == 5 and large < small


def test_a_tie_goes_to_the_shorter_length():
    policy = _measured(2, 1, lambda k: 0.01 * (1 + k), 1.0)  # each draft adds a token and a step's cost exactly
    assert best_length(policy, 1, (0, 1, 2)) == 0


def test_warm_up_times_every_length_longest_first_then_exploits():
    policy = DraftPolicy(3)
    order = []
    for _ in range(4 * WARMUP_SAMPLES):
        k, reason = choose(policy, 8, (0, 1, 2, 3))
        assert reason == "warm-up"
        order.append(k)
        record_cost(policy, 8, k, DEAR_ROWS(k))
        record_acceptance(policy, k, [0] * 8)
    assert order == [k for k in (3, 2, 1, 0) for _ in range(WARMUP_SAMPLES)]
    assert choose(policy, 8, (0, 1, 2, 3)) == (0, "best")


def test_the_longest_length_runs_until_acceptance_rests_on_enough_requests():
    """At batch 1 its two timed steps are two draws of the acceptance: it runs on to ACCEPTANCE_WARMUP verified
    requests before the policy compares lengths (the draws here are unlucky at first, then fair)."""
    policy = DraftPolicy(5)
    order = []
    for step in range(draft_policy.ACCEPTANCE_WARMUP + WARMUP_SAMPLES):
        k, reason = choose(policy, 1, (0, 5))
        assert reason == "warm-up"
        order.append(k)
        record_cost(policy, 1, k, 0.010 * (2.4 if k else 1.0))
        if k:
            record_acceptance(policy, k, [0 if step < 3 else 4])
    assert order == [5] * draft_policy.ACCEPTANCE_WARMUP + [0] * WARMUP_SAMPLES
    assert policy.verified_requests == draft_policy.ACCEPTANCE_WARMUP
    # its first two draws alone (no accepted draft) would have chosen plain decoding; all of them choose drafts
    assert choose(policy, 1, (0, 5)) == (5, "best")


def test_probes_re_time_the_other_lengths_within_the_budget_on_a_fixed_schedule():
    """Past warm-up a length other than the best is re-timed when due: the further below the best, the rarer, so
    that probing costs about PROBE_BUDGET of the throughput; two runs with the same measurements decide alike."""
    choices = (0, 1, 2, 3)

    def run(decisions: int):
        policy = _measured(3, 4, DEAR_ROWS, 0.1)
        made = []
        for _ in range(decisions):
            k, reason = choose(policy, 4, choices)
            made.append((k, reason))
            record_cost(policy, 4, k, DEAR_ROWS(k))
        return policy, made

    policy, made = run(8000)
    rates = tokens_per_second(policy, 4, choices)
    assert max(rates, key=rates.get) == 0  # drafts do not pay here: plain decoding is the best
    probes = [(i, k) for i, (k, reason) in enumerate(made) if reason == "probe"]
    # the closest to the best is due first, after 3 (s (1 - r) + w) / PROBE_BUDGET decisions (a probe runs s steps
    # and switches twice)
    first_due = min(3 * (PROBE_STEPS * (1 - rates[k] / rates[0]) + draft_policy.PROBE_SWITCH_STEPS) / PROBE_BUDGET
                    for k in (1, 2, 3))
    assert probes[0][0] == int(-(-first_due // 1)) and probes[0][1] == 1
    assert {k for _, k in probes} == {1, 2, 3}  # every other length is seen again
    # in best-length steps, each probe priced at the steps it runs in the overlapped steps (here: one, timed at once)
    # and its switches
    lost = sum(probe_price(rates[k] / rates[0]) for _, k in probes)
    assert lost <= 1.5 * PROBE_BUDGET * len(made)
    assert all(k == 0 for k, reason in made if reason == "best")
    assert run(8000)[1] == made


def test_a_probe_is_held_until_its_length_is_timed_or_for_probe_hold_decisions():
    """The overlapped steps time a length only inside a run of it, so a probe goes on until booked; the
    acceptance a step books meanwhile (which moves the due time) does not cut it short; a length that cannot be
    timed is let go after PROBE_HOLD decisions."""
    choices = (0, 1, 2, 3)
    policy = _measured(3, 4, DEAR_ROWS, 0.1)
    made = [choose(policy, 4, choices) for _ in range(1600)]
    first = next(i for i, (_, reason) in enumerate(made) if reason == "probe")
    probed = made[first][0]
    assert made[first:first + draft_policy.PROBE_HOLD] == [(probed, "probe")] * draft_policy.PROBE_HOLD
    assert made[first + draft_policy.PROBE_HOLD] == (0, "best")  # let go, and due again only after its interval
    policy = _measured(3, 4, DEAR_ROWS, 0.1)
    made = [choose(policy, 4, choices) for _ in range(first + 1)]
    record_acceptance(policy, 3, [0] * 64)  # the rates move: no longer due, but held
    assert choose(policy, 4, choices) == (probed, "probe")
    record_cost(policy, 4, probed, DEAR_ROWS(probed))  # timed: the hold ends
    assert choose(policy, 4, choices) == (0, "best")


def test_a_length_as_good_as_the_best_is_re_timed_after_its_switches_price():
    """A tie costs a probe no tokens, only its switches: due every PROBE_SWITCH_STEPS / PROBE_BUDGET decisions,
    never sooner than MIN_PROBE_INTERVAL."""
    # k = 1 always accepted: 2 tokens for twice a plain step's cost, less the margin drafts must clear: a tie
    for switch_steps, interval in ((draft_policy.PROBE_SWITCH_STEPS, round(probe_price(1.0) / PROBE_BUDGET)),
                                   (0.0, MIN_PROBE_INTERVAL)):
        policy = _measured(1, 2, lambda k: 0.02 / (1 + draft_policy.DRAFT_MARGIN) if k else 0.01, 1.0)
        made = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(draft_policy, "PROBE_SWITCH_STEPS", switch_steps)
            for _ in range(3 * interval):
                made.append(choose(policy, 2, (0, 1)))
                record_cost(policy, 2, made[-1][0], policy.costs[2, made[-1][0]])
        probes = [i for i, (_, reason) in enumerate(made) if reason == "probe"]
        assert probes == [interval, 2 * interval + 1]  # each due its interval after its last


def test_buckets_learn_apart():
    policy = _measured(2, 1, CHEAP_ROWS, 0.9)
    k, reason = choose(policy, 40, (0, 1, 2))  # bucket 64 has no costs yet
    assert (k, reason) == (2, "warm-up")
    assert choose(policy, 1, (0, 1, 2)) == (2, "best")


def test_padded_steps_choose_between_plain_and_the_longest():
    policy = _measured(5, 16, lambda k: 0.02 if k else 0.01, 0.3)
    assert choose(policy, 16, (0, 5))[0] == 0
    _accepting(policy, 0.9)
    assert choose(policy, 16, (0, 5))[0] == 5


def test_acceptance_is_the_share_of_requests_that_emit_each_draft():
    policy = DraftPolicy(3)
    assert policy.acceptance == [0.5, 0.5, 0.5]  # the prior, until measured
    decay, prior_offered, prior_emitted = (draft_policy.ACCEPTANCE_DECAY, draft_policy.PRIOR_OFFERED,
                                           draft_policy.PRIOR_EMITTED)
    # a step of length 3 whose three requests accepted 3, 1 and 0 drafts (the last maybe cut by its confidence:
    # it counts, the cut is part of what the length yields)
    record_acceptance(policy, 3, [3, 1, 0])
    expected = [(decay * prior_emitted + e) / (decay * prior_offered + 3) for e in (2, 1, 1)]
    assert policy.acceptance == pytest.approx(expected)
    record_acceptance(policy, 1, [0, 0])  # a step of length 1 says nothing of positions 1 and 2
    assert policy.acceptance[0] < expected[0] and policy.offered[1] == pytest.approx(decay * prior_offered + 3)
    for _ in range(500):  # a long run of rejections outweighs the past
        record_acceptance(policy, 3, [0] * 8)
    assert max(policy.acceptance) < 0.01


def test_a_cost_is_the_median_of_the_last_steps():
    policy = DraftPolicy(1)
    for seconds in (0.010, 0.011, 0.500, 0.012):  # a stall of the shared host does not move it
        record_cost(policy, 2, 1, seconds)
    assert policy.costs[2, 1] == pytest.approx(0.0115) and policy.samples[2, 1] == 4
    for _ in range(draft_policy.COST_WINDOW):  # the window forgets: costs drift as contexts grow
        record_cost(policy, 2, 1, 0.020)
    assert policy.costs[2, 1] == pytest.approx(0.020)


@pytest.mark.parametrize("call, message", [
    (lambda p: choose(p, 1, ()), "draft lengths to choose from"),
    (lambda p: choose(p, 1, (0, 4)), r"must be in \[0, 3\]"),
    (lambda p: record_cost(p, 1, 0, 0.0), "must be > 0 seconds"),
    (lambda p: best_length(p, 1, (0, 1)), "no measured cost"),
    (lambda p: record_acceptance(p, 4, [0]), r"draft length must be in \[0, 3\]"),
])
def test_bad_input_is_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(DraftPolicy(3))


@pytest.mark.parametrize("max_drafts", [0, -1, True, 2.0])
def test_the_policy_needs_at_least_one_draft(max_drafts):
    with pytest.raises(ValueError, match="max_drafts >= 1"):
        DraftPolicy(max_drafts)


def test_summary_names_choices_costs_and_acceptance():
    policy = _measured(2, 1, CHEAP_ROWS, 0.5)
    choose(policy, 1, (0, 1, 2))
    line = draft_policy.summary(policy)
    assert "draft policy (measured) since the engine started" in line and "b1/k0" in line
    assert "acceptance by position [0.500, 0.250]" in line


def test_an_unknown_policy_is_refused():
    from deepinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="speculation_policy .*DEEPINFER_SPECULATION_POLICY.* must be one of measured, floor"):
        EngineConfig(speculation_policy="fastest")


def test_drafts_must_clear_the_margin():
    """A length that promises a little more than plain decoding per step is not taken: requests that accept less
    than the mean would be left decoding in small batches at the end."""
    gain = 1 + draft_policy.DRAFT_MARGIN / 2
    policy = _measured(1, 8, lambda k: 0.02 / gain if k else 0.01, 1.0)  # 2 tokens for 2 / gain plain steps
    assert best_length(policy, 8, (0, 1)) == 0
    policy = _measured(1, 8, lambda k: 0.02 / (2 * gain) if k else 0.01, 1.0)
    assert best_length(policy, 8, (0, 1)) == 1


def test_a_lone_request_needs_no_margin():
    """Batch 1 has no stragglers: a length that promises more tokens per second than plain decoding is taken, where
    batch 8 with the same costs and acceptance decodes without drafts."""
    gain = 1 + draft_policy.DRAFT_MARGIN / 2
    policy = _measured(1, 8, lambda k: 0.02 / gain if k else 0.01, 1.0)
    for _ in range(WARMUP_SAMPLES):
        for k in (0, 1):
            record_cost(policy, 1, k, policy.costs[8, k])
    assert best_length(policy, 1, (0, 1)) == 1 and best_length(policy, 8, (0, 1)) == 0


def test_a_probe_is_priced_and_held_for_the_steps_the_clock_needs():
    """The overlapped steps book a run's periods from its STEADY_FROM-th step's, at the next launch: a probe runs
    that many steps plus one, which its due time prices, and is held at least as long."""
    from deepinfer.engine.run_clock import STEADY_FROM

    assert draft_policy.PROBE_STEPS == STEADY_FROM + 1 and draft_policy.PROBE_HOLD >= draft_policy.PROBE_STEPS
