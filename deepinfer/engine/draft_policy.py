"""The measured draft-length policy of confidence scheduling (``DEEPINFER_SPECULATION_POLICY=measured``).

Drafts pay only when the tokens they add outrun what they cost, and both sides are measured here rather than
guessed. Per batch bucket (the next power of two of the requests decoding) the engine times every decode-only step
and books it under the draft length ``k`` that was chosen for it (``record_cost``): the step's wall time plus the
draft pass that produced its drafts (``k = 0``: no draft pass, only the drafter's store of the computed rows, which
every step pays). Each step with drafts books, per draft position ``j`` below its length, how many of its requests
had draft ``j`` accepted (``record_acceptance``): ``e_j``, the share of requests that emit draft ``j`` when a step
may verify it. That share already holds every cut a request's drafts get (its confidence, ``max_tokens``), so
``1 + e_0 + ... + e_{k-1}`` is what a step of length ``k`` is expected to emit per request.

The rule (``choose``), for the step about to be drafted for, over the lengths the engine can run (``choices``):

1. warm-up: a length with fewer than ``WARMUP_SAMPLES`` timed steps in this bucket runs first (longest first,
   which also measures acceptance at every position), the longest until ``ACCEPTANCE_WARMUP`` requests' drafts
   have been verified too: a mean acceptance length is a noisy draw per step, and what a step or two measured would
   otherwise decide until the next probe, hundreds of decisions later;
2. probe: a length other than the best is re-timed when due, so that costs and acceptance that drift are seen
   again; it is due ``n (s (1 - r) + w) / PROBE_BUDGET`` decisions after it was last timed, ``r`` its expected
   tokens per second relative to the best's, ``s`` the steps a probe runs (``PROBE_STEPS``), ``w`` what switching
   into the probe's run and back costs, in steps of the best (``PROBE_SWITCH_STEPS``), and ``n`` the number of
   other lengths (at least ``MIN_PROBE_INTERVAL``), so probes cost the bucket at most about ``PROBE_BUDGET`` of
   its throughput; the most overdue goes first. A probe is chosen again until its length is timed (at most
   ``PROBE_HOLD`` decisions): the overlapped steps time a step only inside a run of its length, from its third.
   Priced as one step each, probes of four took 13% of the H100's decisions at batch 1 and 32 (embedded model,
   0.81x and 0.86x of decoding without drafts). The schedule follows the counts and the estimates only: no
   random draws;
3. otherwise the best: the length with the most expected tokens per second, ``(1 + e_0 + ... + e_{k-1}) /
   cost(k)``, drafts' discounted by ``1 + DRAFT_MARGIN`` where a batch has requests to straggle (bucket > 1),
   ties to the shorter. ``k = 0`` (plain decoding: no
   drafts, no draft pass) wins wherever drafts do not pay.

Wall time is what a synchronous step costs the engine whatever the device does (the step waits for its result);
an overlapped step (``engine/overlapped_speculation.py``) is timed launch to launch, its period in steady decoding,
and only inside a run of steps of its length (``engine/run_clock.py``: a run's first two periods and its last
step's wait are not steady).
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from deepinfer.logger import init_logger

logger = init_logger(__name__)

WARMUP_SAMPLES = 2  # timed steps per (bucket, length) before the policy trusts its cost
# requests' verified drafts before the policy trusts its acceptance: at batch 1 the longest length's warm-up saw 4-7
# steps, which measured 2.3-2.6 where 78 steps measured 3.4 (synthetic L = 3.5), and the policy then decoded
# without drafts at 0.97x where drafts ran at 1.30x (H100, V4.1-Flash shapes, 2026-12-06). 16 puts the standard
# error of the mean near 0.3 tokens at L = 3.5
ACCEPTANCE_WARMUP = 16
PROBE_BUDGET = 0.01  # the share of a bucket's throughput that re-timing the lengths other than the best may cost
MIN_PROBE_INTERVAL = 16  # decisions between re-timings of one length at least, however close it is to the best
# the steps a probe of a length runs for: the overlapped steps book a run's periods from its third step's, at its
# fourth launch (``engine/run_clock.py``'s STEADY_FROM + 1); its due time prices all of them
PROBE_STEPS = 4
PROBE_HOLD = PROBE_STEPS + 1  # decisions a probe is held for until its length is timed (one for slack)
# a switch between lengths drains the overlapped steps' pipeline: the launch after it came 2.8-3.5 ms after the one
# before, 1.7-1.8 ms more than the run's period (H100, embedded model, batch 1, 2026-12-06:
# tools/profiling/policy_plain_steps.py's run_start_gaps_ms), about 1.7 plain steps; a probe switches twice
PROBE_SWITCH_STEPS = 3.5
# drafts must promise this much more than plain decoding per second: a step's count is a mean over its requests, and
# the ones that accept less than the mean end later, decoding in small batches that cost nearly a full step each
# (the embedded model at batch 8 on a CPU: +16% per step predicted for 5 drafts, 0.87x realized). A lone request has
# no one to wait for: at batch 1 the rate is the request's own (H100, V4.1-Flash shapes: verification at 2.45x a
# plain step, acceptance 3.36 for 1.30x; with the margin, an estimate of 3.4 or less chose plain decoding)
DRAFT_MARGIN = 0.25
# a length's cost is the median of its last few step times: a shared host's stalls (a step 5x its usual time) must
# not decide for dozens of steps, and costs drift as contexts grow
COST_WINDOW = 5
# acceptance counts decay by this per step they are booked in, so a position's share follows the recent text
ACCEPTANCE_DECAY = 0.98
# a prior of one request per position, its draft emitted half the time: 0.5 until measured, which one request's
# first step then moves only halfway
PRIOR_OFFERED, PRIOR_EMITTED = 1.0, 0.5


@dataclass(slots=True)
class DraftPolicy:
    """The policy's running estimates. ``recent[(bucket, k)]``: the last step times (seconds) of a step verifying
    ``k`` drafts per request, ``costs`` their median; ``samples`` how many steps were timed; ``measured_at`` the
    bucket's decision count at the last; ``offered[j]`` and ``emitted[j]`` the decayed counts of requests in steps
    that could verify draft position ``j`` and of those that accepted draft ``j``."""

    max_drafts: int
    recent: dict[tuple[int, int], deque] = field(default_factory=dict)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)
    samples: Counter = field(default_factory=Counter)
    measured_at: dict[tuple[int, int], int] = field(default_factory=dict)
    decisions: Counter = field(default_factory=Counter)  # per bucket
    offered: list[float] = field(default_factory=list)
    emitted: list[float] = field(default_factory=list)
    verified_requests: int = 0  # requests whose drafts a step verified, undecayed: the acceptance's evidence
    chosen: Counter = field(default_factory=Counter)  # per (reason, k): the summary's histogram
    probing: dict[int, _Probe] = field(default_factory=dict)  # per bucket: the probe held until timed

    def __post_init__(self):
        if isinstance(self.max_drafts, bool) or not isinstance(self.max_drafts, int) or self.max_drafts < 1:
            raise ValueError(f"the draft policy needs max_drafts >= 1, got {self.max_drafts!r}")
        self.offered = [PRIOR_OFFERED] * self.max_drafts
        self.emitted = [PRIOR_EMITTED] * self.max_drafts

    def acceptance_counts(self) -> tuple[list[float], list[float], int]:
        """What the acceptance rests on, copied (``restore_acceptance`` puts it back)."""
        return list(self.offered), list(self.emitted), self.verified_requests

    def restore_acceptance(self, counts: tuple[list[float], list[float], int]) -> None:
        offered, emitted, self.verified_requests = counts
        self.offered, self.emitted = list(offered), list(emitted)

    @property
    def acceptance(self) -> list[float]:
        """Per draft position ``j``, the share of requests that emit draft ``j`` where a step may verify it; never
        more than position ``j - 1``'s (draft ``j`` is emitted only after draft ``j - 1``), which keeps a position
        measured from few steps from promising more than the ones before it."""
        shares, ceiling = [], 1.0
        for emitted, offered in zip(self.emitted, self.offered):
            ceiling = min(ceiling, emitted / offered)
            shares.append(ceiling)
        return shares


@dataclass(slots=True)
class _Probe:
    """A probe held until its length is timed: the length, the decision that chose it, its timed steps then."""

    k: int
    since: int
    samples: int


def batch_bucket(requests: int) -> int:
    """The bucket whose costs a step of ``requests`` decoding requests shares: the next power of two."""
    if requests < 1:
        raise ValueError(f"a decode step has at least one request, got {requests}")
    return 1 << (requests - 1).bit_length()


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a request is expected to emit from a step that may verify ``k`` drafts: the token after the last
    accepted draft, plus each draft ``j < k`` with its share of being emitted (``DraftPolicy.acceptance``)."""
    return 1.0 + sum(acceptance[:k])


def choose(policy: DraftPolicy, requests: int, choices: tuple[int, ...]) -> tuple[int, str]:
    """The draft length for the next step of ``requests`` decoding requests, and why (warm-up, probe, best)."""
    if not choices or any(not 0 <= k <= policy.max_drafts for k in choices):
        raise ValueError(f"draft lengths to choose from must be in [0, {policy.max_drafts}], got {choices!r}")
    bucket = batch_bucket(requests)
    decision = policy.decisions[bucket]
    policy.decisions[bucket] += 1
    longest_first = sorted(choices, reverse=True)
    unmeasured = [k for k in longest_first if policy.samples[bucket, k] < WARMUP_SAMPLES
                  or (k == longest_first[0] and k > 0 and policy.verified_requests < ACCEPTANCE_WARMUP)]
    held = policy.probing.pop(bucket, None)
    if held is not None and policy.samples[bucket, held.k] != held.samples:
        held = None  # timed: the hold ends
    elif held is not None and decision - held.since >= PROBE_HOLD:
        policy.measured_at[bucket, held.k] = decision  # not timed in its hold: due again after its interval
        held = None
    if unmeasured:
        k, reason = unmeasured[0], "warm-up"
    elif held is not None and held.k in choices:
        k, reason = held.k, "probe"
        policy.probing[bucket] = held
    else:
        rates = tokens_per_second(policy, bucket, choices)
        best = _fastest(rates)
        others = [k for k in longest_first if k != best]
        # decisions past each other length's due time: its last timing plus its share of the probe budget
        overdue = {k: decision - policy.measured_at[bucket, k]
                   - max(MIN_PROBE_INTERVAL, len(others) * probe_price(rates[k] / rates[best]) / PROBE_BUDGET)
                   for k in others}
        due = [k for k in others if overdue[k] >= 0]
        if due:
            k, reason = max(due, key=lambda k: overdue[k]), "probe"
            policy.probing[bucket] = _Probe(k, decision, policy.samples[bucket, k])
        else:
            k, reason = best, "best"
    policy.chosen[reason, k] += 1
    if logger.isEnabledFor(logging.DEBUG):  # the estimates are formatted only when shown: this runs every step
        logger.debug("draft policy: %d requests (bucket %d), decision %d: %d drafts (%s); cost ms %s, acceptance %s",
                     requests, bucket, decision, k, reason,
                     {j: round(policy.costs[bucket, j] * 1e3, 2) for j in choices if (bucket, j) in policy.costs},
                     [round(a, 3) for a in policy.acceptance])
    return k, reason


def probe_price(relative_rate: float) -> float:
    """What a probe of a length at ``relative_rate`` of the best's tokens per second costs, in the best's steps:
    its steps' shortfall and its two switches."""
    return PROBE_STEPS * (1 - relative_rate) + PROBE_SWITCH_STEPS


def tokens_per_second(policy: DraftPolicy, bucket: int, choices: tuple[int, ...]) -> dict[int, float]:
    """Expected tokens per second per request of each measured length in ``bucket``, drafts' discounted by
    ``DRAFT_MARGIN`` above batch 1: what the choice compares."""
    acceptance = policy.acceptance
    margin = 1 + DRAFT_MARGIN if bucket > 1 else 1.0
    rates = {k: expected_tokens(acceptance, k) / policy.costs[bucket, k] / (margin if k else 1)
             for k in choices if (bucket, k) in policy.costs}
    if not rates:
        raise ValueError(f"no measured cost in bucket {bucket} for lengths {choices!r}")
    return rates


def best_length(policy: DraftPolicy, bucket: int, choices: tuple[int, ...]) -> int:
    """The measured length with the most expected tokens per second in ``bucket`` (the shorter on a tie)."""
    return _fastest(tokens_per_second(policy, bucket, choices))


def _fastest(rates: dict[int, float]) -> int:
    return max(sorted(rates), key=lambda k: rates[k])  # sorted first: a tie goes to the shorter length


def record_cost(policy: DraftPolicy, requests: int, k: int, seconds: float) -> None:
    """A decode step of ``requests`` requests, drafted for with length ``k``, took ``seconds``."""
    if not seconds > 0:
        raise ValueError(f"a step's measured time must be > 0 seconds, got {seconds!r}")
    key = (batch_bucket(requests), k)
    recent = policy.recent.setdefault(key, deque(maxlen=COST_WINDOW))
    recent.append(seconds)
    policy.costs[key] = statistics.median(recent)
    policy.samples[key] += 1
    policy.measured_at[key] = policy.decisions[key[0]]


def record_acceptance(policy: DraftPolicy, length: int, accepted: list[int]) -> None:
    """One step whose requests could verify up to ``length`` drafts each: ``accepted`` per request (a request
    whose own cut left it fewer drafts counts too; that cut is part of what the length yields)."""
    if not 0 <= length <= policy.max_drafts:
        raise ValueError(f"a step's draft length must be in [0, {policy.max_drafts}], got {length!r}")
    if not accepted:
        return
    if length:
        policy.verified_requests += len(accepted)
    for j in range(length):
        policy.offered[j] = ACCEPTANCE_DECAY * policy.offered[j] + len(accepted)
        policy.emitted[j] = ACCEPTANCE_DECAY * policy.emitted[j] + sum(1 for a in accepted if a > j)


def summary(policy: DraftPolicy) -> str:
    """One line for the log: each length chosen how often and why (``b``: batch bucket, ``k``: drafts per
    request), and the estimates now."""
    chosen = ", ".join(f"{k} drafts x{n} ({reason})" for (reason, k), n in sorted(policy.chosen.items(),
                                                                                   key=lambda item: item[0][1]))
    costs = ", ".join(f"b{bucket}/k{k} {seconds * 1e3:.2f}" for (bucket, k), seconds in sorted(policy.costs.items()))
    rates = ", ".join(f"{a:.3f}" for a in policy.acceptance)
    return (f"draft policy (measured) since the engine started: {chosen or 'no decisions'}; step cost ms now "
            f"[{costs}]; acceptance by position [{rates}]")
