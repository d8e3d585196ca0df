"""Where the engine's step time goes, summed over steps: the host phases and the device time they wait for."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class StepMetrics:
    """Seconds summed over ``steps``. Host phases are wall times of the engine's own code: ``schedule``,
    ``prepare`` (building the step's inputs and starting their copy to the device), ``forward`` (launching the
    forward pass and the head; on a CPU, running them), ``sample`` (launching the sampler), ``wait`` (blocked until
    the device has sampled tokens: the previous step's, with asynchronous scheduling), ``outputs``
    (detokenizing, stop checks) and ``draft`` (speculative decoding: the drafter's pass, until its tokens are on
    the host; a verification step's ``sample`` includes waiting for the device). ``device`` is the GPU time from the forward pass's first kernel to the sampler's
    last (CUDA events; only for steps that sample); with asynchronous scheduling it includes the time the step
    queued behind the previous one. Device idle time itself is measured by ``tools/profiling/profile_decode.py --graphs``."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    wait: float = 0.0
    outputs: float = 0.0
    draft: float = 0.0
    device: float = 0.0
    device_steps: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0 if f.name.endswith("steps") else 0.0)

    def per_step_ms(self) -> dict[str, float]:
        """Host phases per step; ``device`` per step that was timed on the device."""
        per_step = {f.name: getattr(self, f.name) * 1e3 / max(self.steps, 1) for f in fields(self)
                    if not f.name.endswith("steps")}
        return per_step | {"device": self.device * 1e3 / max(self.device_steps, 1)}


@dataclass(slots=True)
class EngineTotals:
    """Counts since the engine started (``LLMEngine.counters`` adds the scheduler's and the caches' state)."""

    steps: int = 0
    # asynchronous scheduling: steps whose forward pass was launched before the previous step's tokens were booked
    steps_launched_ahead: int = 0
    prompt_tokens: int = 0  # of the requests added
    cached_prompt_tokens: int = 0  # of finished requests: prompt tokens a prefix-cache hit did not recompute
    generation_tokens: int = 0  # of finished requests
    finished_requests: int = 0
    aborted_requests: int = 0  # ended by LLMEngine.abort (a client gone), not counted as finished

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class StepClock:
    """Times a step's host phases into a ``StepMetrics``; device time comes from CUDA events the step records."""

    def __init__(self, metrics: StepMetrics, device: torch.device):
        self.metrics = metrics
        self.cuda = device.type == "cuda"
        self.last = 0.0

    def start(self) -> None:
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.metrics, phase, getattr(self.metrics, phase) + now - self.last)
        self.last = now

    def event(self) -> torch.cuda.Event | None:
        """A recorded timing event on the current stream (None off CUDA)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, started: torch.cuda.Event | None, done: torch.cuda.Event | None) -> None:
        """Blocks until ``done`` (timed as ``wait``) and adds the device time from ``started`` to it."""
        if done is not None:
            done.synchronize()
            self.metrics.device += started.elapsed_time(done) / 1e3
            self.metrics.device_steps += 1
        self.lap("wait")
