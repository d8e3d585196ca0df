"""How the overlapped speculative steps (``engine/overlapped_speculation.py``) time their steps for the measured
draft policy (``engine/draft_policy.py``).

Only a run's steady periods are booked: from a step's launch to the next step's of the same run, which the host
launches after waiting for the step before (so the period is the device's step, or the host's where it is slower).
A run starts from an idle device (the host waited for the step before it), so its first periods are not steady:
the first is the host's launching alone (the device still runs the step), and the second holds that first step's
whole device time and then the host's resolving of it, in series (in a steady run the host resolves one step
while the device runs the next): up to twice a steady period where host and device take about as long (the
H100's embedded model at batch 32: plain probes booked at ~2x). So a run's periods are booked from its third
step's (``STEADY_FROM``), and its last step, which ends in a wait for its result, not at all: a run of n steps books
n - 3. Every choice the policy makes in warm-up or probe is made again until it is booked, so such a run lasts
until it yields a steady period. A step during which a CUDA graph was captured is not booked either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from deepinfer.engine import draft_policy
from deepinfer.engine.draft_policy import DraftPolicy
from deepinfer.runner import cuda_graphs

STEADY_FROM = 3  # the place in its run of the first step whose period is booked


@dataclass(slots=True)
class _Launched:
    """A launched step not yet booked: when, ``cuda_graphs.captures`` then, its requests, the drafts booked for it,
    and its place in its run (1: launched with no step of its kind in flight)."""

    at: float
    captures: int
    requests: int
    drafts: int
    place: int


class RunClock:
    """``note`` each launch, ``book`` the step before at the next launch of its run, ``end_run`` where the run
    ends (its last step is not booked). Does nothing without a policy."""

    __slots__ = ("policy", "launched", "place")

    def __init__(self, policy: DraftPolicy | None):
        self.policy = policy
        self.launched: _Launched | None = None
        self.place = 0  # the last launch's place in its run

    def note(self, requests: int, drafts: int, first: bool) -> None:
        self.place = 1 if first else self.place + 1
        if self.policy is not None:
            self.launched = _Launched(time.perf_counter(), cuda_graphs.captures, requests, drafts, self.place)

    def book(self) -> None:
        """Books the last launched step, launch to launch, if its run was steady by then and no CUDA graph was
        captured meanwhile."""
        launched, self.launched = self.launched, None
        if launched is not None and launched.place >= STEADY_FROM and launched.captures == cuda_graphs.captures:
            draft_policy.record_cost(self.policy, launched.requests, launched.drafts, time.perf_counter() - launched.at)

    def end_run(self) -> None:
        """The run's last step: its launch to its result is a latency, not a period."""
        self.launched = None
