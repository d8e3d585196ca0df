"""How the engine runs a step: one ``StepMode`` per way of running, each over the same ``StepContext``.

A mode schedules a step (``Scheduler``), runs it (``ModelRunner``), hands the sampled tokens to the outputs and
books the step (``Scheduler.update``). ``DecodeSteps`` samples one token per request, waiting for it or, with
asynchronous scheduling, launching the next step first (``engine/inflight.py``). ``SpeculativeSteps`` verifies
drafts and drafts again after every step (``engine/speculation.py``). ``OverlappedSpeculation``
(``engine/overlapped_speculation.py``) keeps verification on the device in steady decoding, and runs every other
step as ``SpeculativeSteps`` does.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Protocol

from deepinfer.engine.inflight import InFlight
from deepinfer.runner.cuda_graphs import StepTail
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.engine.output_processor import OutputProcessor, host_lists
from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.engine.scheduler import Scheduler
import torch

from deepinfer.engine.speculation import Speculator, accepted_on_host, synthetic_key
from deepinfer.runtime.latency_histograms import RequestLatencies
from deepinfer.runtime.step_metrics import EngineTotals, StepClock, StepMetrics
from deepinfer.plugins.interfaces import SamplerOutput


@dataclass(slots=True)
class StepContext:
    """What every step mode works with."""

    scheduler: Scheduler
    runner: ModelRunner
    outputs: OutputProcessor
    clock: StepClock
    metrics: StepMetrics
    totals: EngineTotals
    latencies: RequestLatencies

    def schedule(self) -> ScheduledBatch:
        """The next step, its scheduling timed."""
        scheduled = self.scheduler.schedule()
        self.clock.lap("schedule")
        return scheduled

    def count_step(self) -> None:
        self.metrics.steps += 1
        self.totals.steps += 1

    def finish(self, requests: list[Request]) -> None:
        for request in requests:
            self.scheduler.finish(request)
        self.count_finished(requests)

    def count_finished(self, requests: list[Request]) -> None:
        for request in requests:
            self.totals.finished_requests += 1
            self.totals.generation_tokens += request.num_output_tokens
            self.totals.cached_prompt_tokens += request.metrics.num_cached_tokens
            self.latencies.observe(request.metrics)


class StepMode(Protocol):
    def step(self) -> list[Request]:
        """Schedules and launches one step; returns the requests found finished in this call."""

    @property
    def in_flight(self) -> bool:
        """Whether a launched step is still to be resolved (its tokens booked)."""


class DecodeSteps:
    """One token per sampling request and step. ``asynchronous``: the host resolves the previous step's tokens
    (detokenizing, stop checks) while the device runs this one, whose inputs take those tokens on the device, or
    on the host first when a model or a sampling penalty needs their values; otherwise each step waits for its
    own tokens."""

    def __init__(self, context: StepContext, asynchronous: bool, after_sampling=None, tail=None):
        self.context, self.asynchronous = context, asynchronous
        self.inflight: InFlight | None = None
        # speculative decoding's plain steps (``OverlappedSpeculation``) keep the drafter's rows: ``tail(scheduled)``
        # gives a ``StepTail`` that samples and stores them in the step's graph, or None where it cannot (a grammar,
        # penalties); ``after_sampling(scheduled, sampled on the device, the forward's features)`` then stores them
        # as the step's sampling is queued
        self.after_sampling, self.tail = after_sampling, tail

    @property
    def in_flight(self) -> bool:
        return self.inflight is not None

    def step(self) -> list[Request]:
        return self.run(self.context.schedule())

    def run(self, scheduled: ScheduledBatch) -> list[Request]:
        context = self.context
        clock, runner = context.clock, context.runner
        if not scheduled:
            runner.idle()
            return self.resolve() if self.inflight is not None else []
        previous = self.inflight
        tokens_on_host = previous is not None and runner.needs_host_tokens(scheduled)
        if tokens_on_host:  # only the values: the outputs (detokenizing, stop checks) still overlap this step
            previous.write_tokens(clock)
        context.count_step()
        if self.inflight is not None:  # still unresolved as this step is launched
            context.totals.steps_launched_ahead += 1
        fill = (lambda token_ids: previous.fill(scheduled, token_ids)) if previous is not None and not tokens_on_host \
            else None
        tail = self.tail(scheduled) if self.tail is not None and runner.replays(scheduled) else None
        if tail is not None:  # the forward pass, sampling and the tail's work: one replay
            finished, launched = [], self._launch_with_tail(scheduled, tail, fill)
        else:
            finished, launched = self._launch(scheduled, fill)
        if self.inflight is not None:  # the previous step's tokens, while the device runs this one
            finished += self.resolve()
        context.scheduler.update(scheduled)
        self.inflight = launched
        if launched is not None and not self.asynchronous:
            finished += self.resolve()
        return finished

    def _launch(self, scheduled: ScheduledBatch, fill) -> tuple[list[Request], InFlight | None]:
        """The step's forward pass, then its sampling queued behind it; returns the requests found finished on
        the way (a grammar resolves the step before) and the step in flight, if it samples."""
        context = self.context
        clock, runner = context.clock, context.runner
        forward = runner.forward(scheduled, fill)
        sampling_requests = scheduled.sampling
        if not sampling_requests:
            return [], None
        finished = []
        if self.inflight is not None and any(r.grammar is not None for r in sampling_requests):
            # a grammar's mask needs the previous token accepted: the previous step is resolved now, while the
            # device runs this step's forward pass (a request it finishes has a row here, discarded later)
            finished += self.resolve()
        sampled = runner.sample(forward.logits, [(r, 0) for r in sampling_requests])
        if self.after_sampling is not None:
            self.after_sampling(scheduled, sampled.token_ids, forward.features)
        launched = InFlight.launch(sampling_requests, sampled, forward.started, clock)
        clock.lap("sample")
        return finished, launched

    def _launch_with_tail(self, scheduled: ScheduledBatch, tail: StepTail, fill) -> InFlight:
        """A step whose every row samples, replayed with ``tail``, which samples them in the graph: its outputs
        are the sampler's, padded to the graph's batch (``SamplerOutput``'s fields, in order)."""
        clock, started = self.context.clock, None

        def complete(inputs):  # the inputs are in place: complete them, time from here
            nonlocal started
            clock.lap("prepare")
            if fill is not None:
                fill(inputs.token_ids)
            started = clock.event()

        padded = self.context.runner.forward_with_tail(scheduled, tail, complete, values_on_device=False)
        clock.lap("forward")
        count = len(scheduled)
        sampled = SamplerOutput(*(None if t is None else t[:count] for t in padded))
        launched = InFlight.launch(scheduled.sampling, sampled, started, clock)
        clock.lap("sample")
        return launched

    def resolve(self) -> list[Request]:
        """Waits for the step in flight's tokens and hands them to the outputs; returns the requests they end."""
        context = self.context
        inflight, self.inflight = self.inflight, None
        host = inflight.wait(context.clock)
        finished = context.outputs.resolve(inflight.requests, inflight.positions, host)
        context.finish(finished)
        context.clock.lap("outputs")
        return finished


class SpeculativeSteps:
    """Speculative decoding's steps, each waiting for its own result (``engine/speculation.py``): samples every
    verified row, keeps each request's accepted drafts and the token after them, books them, then drafts for the
    next step."""

    in_flight = False

    def __init__(self, context: StepContext, speculator: Speculator):
        self.context, self.speculator = context, speculator

    def step(self) -> list[Request]:
        return self.run(self.context.schedule())

    def run(self, scheduled: ScheduledBatch) -> list[Request]:
        context = self.context
        if not scheduled:
            context.runner.idle()
            return []
        started = time.perf_counter()  # the measured draft policy prices the step by its wall time
        context.count_step()
        sampling_requests = scheduled.sampling
        forward = context.runner.forward(scheduled)
        logits = forward.logits
        finished, accepted = [], {}
        if sampling_requests:
            rows = self.speculator.rows(sampling_requests)
            sampled = host_lists(context.runner.sample(logits, rows))
            context.clock.lap("sample")
            now, first, tokens = time.monotonic(), 0, sampled["token_ids"]
            starts = list(itertools.accumulate((r.num_drafts + 1 for r in sampling_requests), initial=0))
            if self.speculator.synthetic_rate is None:
                counts = accepted_on_host([r.draft_token_ids for r in sampling_requests],
                                          [tokens[a:b] for a, b in itertools.pairwise(starts)])
            else:
                counts = self._synthetic(sampling_requests, starts, tokens)
            for request, count in zip(sampling_requests, counts):
                drafted = request.num_drafts
                if drafted:
                    self.speculator.stats.record(request, drafted, count)
                request.drop_drafts()
                accepted[request] = count
                if context.outputs.extend(request, list(range(first, first + count + 1)), sampled, now):
                    finished.append(request)
                first += drafted + 1
        kept = context.scheduler.update(scheduled, accepted, finished)
        context.count_finished(finished)
        context.clock.lap("outputs")
        self.speculator.record_step(scheduled, [accepted.get(r, 0) for r in sampling_requests],
                                    time.perf_counter() - started)
        self.speculator.draft(context.scheduler.running, kept, forward.features)
        context.clock.lap("draft")
        return finished

    def _synthetic(self, requests: list[Request], starts: list[int], tokens: list[int]) -> list[int]:
        """Synthetic acceptance (benchmarks only, ``speculation.synthetic_accepted``): drawn counts, and in
        ``tokens`` each accepted row's sampled token replaced by its draft, which is what the step emits."""
        counts = self.speculator.synthetic_counts(
            torch.tensor([synthetic_key(r) for r in requests], dtype=torch.int64),
            # the step's first row: the last token before the drafts
            torch.tensor([len(r.token_ids) - r.num_drafts - 1 for r in requests], dtype=torch.int64),
            torch.tensor([r.num_drafts for r in requests], dtype=torch.int64)).tolist()
        for request, start, count in zip(requests, starts, counts):
            tokens[start:start + count] = request.draft_token_ids[:count]
        return counts
