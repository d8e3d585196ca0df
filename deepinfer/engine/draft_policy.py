"""The measured draft-length policy of confidence scheduling (``DEEPINFER_SPECULATION_POLICY=measured``).

Drafts pay only when the tokens they add outrun what they cost, and both sides are measured here rather than
guessed. Per batch bucket (the next power of two of the requests decoding) the engine times every decode-only step
and books it under the draft length ``k`` that was chosen for it (``record_cost``): the step's wall time plus the
draft pass that produced its drafts (``k = 0``: no draft pass, only the drafter's store of the computed rows, which
every step pays). Each verified step books its accepted counts per draft position (``record_acceptance``) into an
estimate of the conditional acceptance rate ``a_j`` (draft ``j`` accepted given drafts ``0..j-1`` were).

The rule (``choose``), for the step about to be drafted for, over the lengths the engine can run (``choices``):

1. warm-up: a length with fewer than ``WARMUP_SAMPLES`` timed steps in this bucket is run first (longest first,
   which also measures acceptance at every position);
2. probe: every ``PROBE_INTERVAL``-th decision of a bucket runs the length measured longest ago, so costs and
   acceptance that drift are seen again (a deterministic schedule: runs repeat);
3. otherwise the length with the most expected tokens per second: ``(1 + a_0 + a_0 a_1 + ... + a_0..a_{k-1}) /
   cost(k)``, ties to the shorter. ``k = 0`` (plain decoding: no drafts, no draft pass) wins wherever drafts do
   not pay.

Wall time is what a synchronous step costs the engine whatever the device does (the step waits for its result);
an overlapped step (``engine/overlapped_speculation.py``) is timed launch to launch, its period in steady decoding.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from deepinfer.logger import init_logger

logger = init_logger(__name__)

WARMUP_SAMPLES = 2  # timed steps per (bucket, length) before the policy trusts its cost
PROBE_INTERVAL = 16  # every this many decisions of a bucket, re-time the length measured longest ago
# a length's cost is the median of its last few step times: a shared host's stalls (a step 5x its usual time) must
# not decide for dozens of steps, and costs drift as contexts grow
COST_WINDOW = 5
# acceptance counts decay by this per step they are booked in, so a position's rate follows the recent text
ACCEPTANCE_DECAY = 0.98
# a prior of one request reaching each position, half accepted: a rate of 0.5 until measured, which one request's
# first step then moves only halfway
PRIOR_REACHED, PRIOR_ACCEPTED = 1.0, 0.5


@dataclass(slots=True)
class DraftPolicy:
    """The policy's running estimates. ``recent[(bucket, k)]``: the last step times (seconds) of a step verifying
    ``k`` drafts per request, ``costs`` their median; ``samples`` how many steps were timed; ``measured_at`` the
    bucket's decision count at the last; ``reached[j]`` and ``accepted[j]`` the decayed counts of requests that
    reached draft position ``j`` and of those that accepted it."""

    max_drafts: int
    recent: dict[tuple[int, int], deque] = field(default_factory=dict)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)
    samples: Counter = field(default_factory=Counter)
    measured_at: dict[tuple[int, int], int] = field(default_factory=dict)
    decisions: Counter = field(default_factory=Counter)  # per bucket
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    chosen: Counter = field(default_factory=Counter)  # per (reason, k): the summary's histogram

    def __post_init__(self):
        if isinstance(self.max_drafts, bool) or not isinstance(self.max_drafts, int) or self.max_drafts < 1:
            raise ValueError(f"the draft policy needs max_drafts >= 1, got {self.max_drafts!r}")
        self.reached = [PRIOR_REACHED] * self.max_drafts
        self.accepted = [PRIOR_ACCEPTED] * self.max_drafts

    @property
    def acceptance(self) -> list[float]:
        """The conditional acceptance rate of each draft position."""
        return [a / r for a, r in zip(self.accepted, self.reached)]


def batch_bucket(requests: int) -> int:
    """The bucket whose costs a step of ``requests`` decoding requests shares: the next power of two."""
    if requests < 1:
        raise ValueError(f"a decode step has at least one request, got {requests}")
    return 1 << (requests - 1).bit_length()


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Tokens a request is expected to emit from a step verifying ``k`` drafts: the token after the last accepted
    draft, plus each draft ``j < k`` with the chance that it and every draft before it are accepted."""
    total, survival = 1.0, 1.0
    for rate in acceptance[:k]:
        survival *= rate
        total += survival
    return total


def choose(policy: DraftPolicy, requests: int, choices: tuple[int, ...]) -> tuple[int, str]:
    """The draft length for the next step of ``requests`` decoding requests, and why (warm-up, probe, best)."""
    if not choices or any(not 0 <= k <= policy.max_drafts for k in choices):
        raise ValueError(f"draft lengths to choose from must be in [0, {policy.max_drafts}], got {choices!r}")
    bucket = batch_bucket(requests)
    decision = policy.decisions[bucket]
    policy.decisions[bucket] += 1
    longest_first = sorted(choices, reverse=True)
    unmeasured = [k for k in longest_first if policy.samples[bucket, k] < WARMUP_SAMPLES]
    if unmeasured:
        k, reason = unmeasured[0], "warm-up"
    else:
        best = best_length(policy, bucket, choices)
        if decision % PROBE_INTERVAL == PROBE_INTERVAL - 1 and len(choices) > 1:
            others = [k for k in longest_first if k != best]
            k, reason = min(others, key=lambda k: policy.measured_at.get((bucket, k), -1)), "probe"
        else:
            k, reason = best, "best"
    policy.chosen[reason, k] += 1
    logger.debug("draft policy: %d requests (bucket %d), decision %d: %d drafts (%s); cost ms %s, acceptance %s",
                 requests, bucket, decision, k, reason,
                 {k: round(policy.costs[bucket, k] * 1e3, 2) for k in choices if (bucket, k) in policy.costs},
                 [round(a, 3) for a in policy.acceptance])
    return k, reason


def best_length(policy: DraftPolicy, bucket: int, choices: tuple[int, ...]) -> int:
    """The measured length with the most expected tokens per second in ``bucket`` (the shorter on a tie)."""
    acceptance = policy.acceptance
    rates = {k: expected_tokens(acceptance, k) / policy.costs[bucket, k] for k in choices
             if (bucket, k) in policy.costs}
    if not rates:
        raise ValueError(f"no measured cost in bucket {bucket} for lengths {choices!r}")
    return max(sorted(rates), key=lambda k: rates[k])


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


def record_acceptance(policy: DraftPolicy, verified: list[int], accepted: list[int]) -> None:
    """One step's drafts: per request, how many were verified and how many of them accepted. Position ``j``'s
    rate is measured over the requests that reached it (verified more than ``j``, the ``j`` before accepted)."""
    for j in range(policy.max_drafts):
        reached = sum(1 for v, a in zip(verified, accepted) if v > j and a >= j)
        if not reached:
            continue
        policy.reached[j] = ACCEPTANCE_DECAY * policy.reached[j] + reached
        policy.accepted[j] = ACCEPTANCE_DECAY * policy.accepted[j] + sum(
            1 for v, a in zip(verified, accepted) if v > j and a > j)


def summary(policy: DraftPolicy) -> str:
    """One line for the log: what was chosen how often, and the estimates now."""
    chosen = ", ".join(f"{k} drafts x{n} ({reason})" for (reason, k), n in sorted(policy.chosen.items(),
                                                                                   key=lambda item: item[0][1]))
    costs = ", ".join(f"b{bucket}/k{k} {seconds * 1e3:.2f}" for (bucket, k), seconds in sorted(policy.costs.items()))
    rates = ", ".join(f"{a:.3f}" for a in policy.acceptance)
    return f"draft policy (measured): {chosen or 'no decisions'}; step cost ms [{costs}]; acceptance by position [{rates}]"
