"""How the overlapped speculative steps (``engine/overlapped_speculation.py``) time their steps for the measured
draft policy (``engine/draft_policy.py``).

Only a run's steady periods are booked: from a step's launch to the next step's of the same run, which the host
launches after waiting for the step before (so the period is the device's step, or the host's where it is slower).
A run's first period is the host's launching alone (the device still runs the step) and its last step ends in a
wait for its result (a whole latency, not a period): booking either biased a probe of one or two steps (the H100's
embedded model: isolated plain steps booked at their latency kept 5 drafts against cheaper plain decoding). Every
choice the policy makes in warm-up or probe is made again until it is booked, so such a run lasts until it yields
a steady period. A step during which a CUDA graph was captured is not booked either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepinfer.engine import draft_policy
from deepinfer.engine.draft_policy import DraftPolicy
from deepinfer.runner import cuda_graphs


@dataclass(slots=True)
class _Launched:
    """A launched step not yet booked: when, ``cuda_graphs.captures`` then, its requests, the drafts booked for it,
    and whether it began its run (launched with no step of its kind in flight)."""

    at: float
    captures: int
    requests: int
    drafts: int
    first: bool


class RunClock:
    """``note`` each launch, ``book`` the step before at the next launch of its run, ``end_run`` where the run
    ends (its last step is not booked). Does nothing without a policy."""

    __slots__ = ("policy", "launched")

    def __init__(self, policy: DraftPolicy | None):
        self.policy = policy
        self.launched: _Launched | None = None

    def note(self, requests: int, drafts: int, first: bool) -> None:
        if self.policy is not None:
            self.launched = _Launched(time.perf_counter(), cuda_graphs.captures, requests, drafts, first)

    def book(self) -> None:
        """Books the last launched step, launch to launch, unless it began its run or a CUDA graph was captured
        meanwhile."""
        launched, self.launched = self.launched, None
        if launched is not None and not launched.first and launched.captures == cuda_graphs.captures:
            draft_policy.record_cost(self.policy, launched.requests, launched.drafts, time.perf_counter() - launched.at)

    def end_run(self) -> None:
        """The run's last step: its launch to its result is a latency, not a period."""
        self.launched = None
