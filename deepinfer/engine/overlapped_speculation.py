"""Speculative decoding with asynchronous scheduling: a verification step is launched before the host has the
previous one's result.

A step's outcome stays on the device: the verifier samples every row, counts each request's accepted drafts
(``accepted_counts``) and the drafter drafts from the new last token (``Drafter.propose_on_device``), all
queued behind the forward pass. The host copies of those results are read one step later. Meanwhile the next step
is scheduled as if every draft had been accepted: at ``start + rows`` with blocks reserved up to there, and inputs
the device then corrects before the forward pass reads them. Its positions become ``start + accepted + 1``, its
tokens the previous step's last sampled token and drafts, and (V4.1's Engram) its token history is taken from the
previous step's rows. The sampler's output positions (``seq_seed`` noise) get the same offset. Everything else a
step reads is derived from those positions on the device (``ForwardBatchBuilder.derive``), so a step that follows
a step with rejected drafts computes the same rows as if the host had waited.

Where the engine replays CUDA graphs, the step's tail (the vocabulary projection of every row, sampling,
acceptance, the drafter's store and pass, the next step's lengths: ``_tail``) is captured in the same graph as its
forward pass (``DecodeGraphs.with_tail``): a step costs the host a handful of small corrections and one replay,
instead of the hundred-odd launches of those pieces, which on a small model took longer than the device's step.
The tail reads its per-request values (sampling parameters, the drafter's slots, ends) from the step's staged
inputs, so one graph serves every batch with the same sampling flags.

A following step is launched only in the steady state, where nothing about it depends on the unknown count: the
same requests as the step before (none added), each with room for a full step whatever was accepted, every step
padded to ``1 + max_drafts`` rows per request (the CUDA graphs' shape), none needing its tokens on the host
(grammars, penalties, host-side Engram tables). Otherwise the host first resolves the step in flight, and the
next step is scheduled as usual and runs as a synchronous verification step (``steps.SpeculativeSteps``): the
first step of a steady run (from the host's drafts) is again launched here when it qualifies.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.runner import cuda_graphs
from deepinfer.runner.cuda_graphs import StepTail
from deepinfer.engine.output_processor import host_lists
from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runner.sampling_batch import SamplingFlags, padded_sampling_rows, sampling_batch
from deepinfer.engine import draft_policy
from deepinfer.engine.speculation import (accepted_counts, draft_room, drafts_in_accepted_rows, synthetic_key,
                                          verified_lengths)
from deepinfer.engine.plain_store import PlainStepStore, device_ready
from deepinfer.engine.run_clock import RunClock
from deepinfer.engine.steps import DecodeSteps, SpeculativeSteps, StepContext
from deepinfer.runtime.transfer import to_device, to_host
from deepinfer.plugins.interfaces import SamplerOutput


_VERIFIED = 3  # the row of the tail's integer inputs (``_tail_inputs``) with each request's drafts verified


class _Outcome:
    """What a verification step leaves on the device, per request, side by side in one tensor [B, 2 * rows + 2]
    (one copy to the host): the token sampled at each row, the next step's drafts (zero padded), the drafts
    accepted, the drafts that counted (the rest of the rows were padding), how many of the next drafts the next
    step verifies."""

    __slots__ = ("packed", "rows")

    def __init__(self, packed: torch.Tensor, rows: int):
        self.packed, self.rows = packed, rows

    @staticmethod
    def pack(sampled, drafts, accepted, verified, lengths) -> torch.Tensor:
        return torch.cat([sampled, drafts, torch.stack([accepted, verified, lengths], 1)], 1)

    @property
    def sampled(self) -> torch.Tensor:
        return self.packed[:, :self.rows]

    @property
    def drafts(self) -> torch.Tensor:
        return self.packed[:, self.rows:2 * self.rows - 1]

    @property
    def accepted(self) -> torch.Tensor:
        return self.packed[:, 2 * self.rows - 1]

    @property
    def lengths(self) -> torch.Tensor:
        return self.packed[:, 2 * self.rows + 1]

    @staticmethod
    def unpack(row: list[int], rows: int) -> tuple[list[int], list[int], int, int, int]:
        """One request's row of ``packed`` on the host: sampled tokens, drafts, accepted, verified, lengths."""
        return row[:rows], row[rows:2 * rows - 1], *row[2 * rows - 1:]


@dataclass(slots=True)
class SpeculativeInFlight:
    batch: ScheduledBatch
    positions: torch.Tensor  # [B] on the device: each request's first position in the step
    history: torch.Tensor | None  # [B, h + rows] token ids from ``h`` positions before the first row (Engram)
    outcome: _Outcome  # on the device (a CUDA graph's output: read before the graph's next replay rewrites it)
    host: torch.Tensor  # ``outcome.packed`` in host memory, complete once ``ready`` is
    logprobs: SamplerOutput  # host copies of the sampler's logprob outputs per row (None where none was asked)
    started: torch.cuda.Event | None
    ready: torch.cuda.Event | None

    def wait(self, clock) -> tuple[list[list[int]], SamplerOutput]:
        clock.wait(self.started, self.ready)
        self.ready = None
        return self.host.tolist(), self.logprobs

    @property
    def requests(self) -> list[Request]:
        return self.batch.requests


class OverlappedSpeculation:
    """A step mode (``engine/steps.py``): steady runs of verification steps stay on the device; every other step
    is one of ``synchronous``'s."""

    def __init__(self, context: StepContext, synchronous: SpeculativeSteps):
        self.context, self.synchronous = context, synchronous
        self.runner = context.runner
        self.speculator = synchronous.speculator
        self.rows = 1 + self.speculator.max_drafts
        self.inflight: SpeculativeInFlight | None = None
        # "first" of a steady run, "following" a step in flight; "plain": the policy's plain steps (no drafts)
        # launched before the step in flight was resolved
        self.launches = Counter()
        self.clock = RunClock(self.speculator.policy)  # the measured policy's timing of the steps launched here
        self._plain_next = False  # the policy ended the steady run: the step resolved next keeps no drafts
        # the measured policy's plain steps (no drafts), launched before the host resolves the step in flight as
        # decoding without drafts is; their rows reach the drafter on the device (``Drafter.store_on_device``, in
        # the step's graph where it replays one: ``engine/plain_store.py``), so drafting resumes after any of
        # them. Without that method plain steps wait for their result.
        drafter = self.speculator.drafter
        self.plain = self.plain_store = None
        if self.speculator.policy is not None and hasattr(drafter, "store_on_device"):
            self.plain_store = store = PlainStepStore(self.runner, drafter)
            self.plain = DecodeSteps(context, asynchronous=True, after_sampling=store.store, tail=store.tail)

    @property
    def in_flight(self) -> bool:
        return self.inflight is not None or (self.plain is not None and self.plain.in_flight)

    def step(self) -> list[Request]:
        if self.plain is not None and self.plain.in_flight:
            return self._plain_step()
        context, previous = self.context, self.inflight
        if previous is not None:
            scheduled = self._schedule_after(previous)
            context.clock.lap("schedule")
            if scheduled is not None:
                self.inflight = self._launch(scheduled, previous)
                return self._resolve(previous)
            finished = self._resolve(previous, keep_drafts=not self._plain_next)
            self.clock.end_run()
            self.inflight = None
        else:
            finished = []
        return finished + self._step_from_host()

    def _step_from_host(self) -> list[Request]:
        """A step with nothing in flight: the first of a steady run, a plain step or a synchronous one. Every
        engine step runs one forward pass (expert-parallel ranks exchange tokens in each)."""
        scheduled = self.context.schedule()
        if scheduled and self._can_launch(scheduled):
            self.inflight = self._launch(scheduled, None)
            return []
        # plain decoding chosen, or drafts chosen and every one cut by its confidence: a plain step either way (a
        # synchronous step here would book its whole latency under the length chosen)
        if self.plain is not None and scheduled and _plain(scheduled):
            return self._launch_plain(scheduled)
        return self.synchronous.run(scheduled)

    # -- plain steps (the measured policy's k = 0) --------------------------------------------------
    def _plain_step(self) -> list[Request]:
        """A plain run goes on while the policy keeps choosing no drafts and every running request decodes
        (nothing arrives, no prefill chunk): the next plain step is launched before the one in flight is resolved.
        Otherwise the run ends: the step in flight is resolved and drafted from (at the length the policy chose
        here, if it did), and this call's step is launched from the host's state."""
        context, s = self.context, self.speculator
        scheduler = context.scheduler
        running, chosen = scheduler.running, None
        if running and not scheduler.waiting and all(r.num_pending == 1 and not r.num_drafts for r in running):
            chosen, _ = draft_policy.choose(s.policy, len(running), s.policy_choices)
            if chosen == 0:
                scheduled = context.schedule()
                if scheduled and not _plain(scheduled):  # the checks above are what the scheduler schedules from
                    raise RuntimeError("a plain run's step was scheduled with other than one row per decoding "
                                       "request")
                return self._launch_plain(scheduled)
        finished = self.plain.resolve()
        self.clock.end_run()
        s.draft(scheduler.running, [], None, chosen)
        return finished + self._step_from_host()

    def _launch_plain(self, scheduled: ScheduledBatch) -> list[Request]:
        """Launches ``scheduled`` as a plain step and books the step before it in the run: launch to launch."""
        if not scheduled:  # nothing could be scheduled: the step in flight is resolved, the run ends
            self.clock.end_run()
            return self.plain.run(scheduled)
        self.clock.book()
        if self.plain.in_flight:
            self.launches["plain"] += 1
        self.speculator.pending_choice = None  # timed here, not as a synchronous step
        if not self.plain.in_flight:  # a run's first step: its requests' slots may have moved since the last run
            self.plain_store.forget()
        self.clock.note(len(scheduled), 0, first=not self.plain.in_flight)
        return self.plain.run(scheduled)

    # -- which steps ------------------------------------------------------------------------------
    def _can_launch(self, scheduled: ScheduledBatch) -> bool:
        """The first step of a steady run: a verification step of decoding requests only, from the host's drafts."""
        if self.speculator.policy is not None and not any(r.num_drafts for r in scheduled.requests):
            return False  # the policy chose plain decoding: a padded verification step would verify nothing
        return (self.runner.replays(scheduled) and not self.runner.model.needs_host_tokens
                and all(device_ready(r) for r in scheduled.requests))

    def _schedule_after(self, previous: SpeculativeInFlight) -> ScheduledBatch | None:
        """The next step of a steady run (``Scheduler.schedule_ahead``); None where the host must first see
        ``previous``'s result."""
        self._plain_next = False
        requests = [r for r in previous.requests if not r.finished]
        if len(requests) > self.runner.graphs.sizes[-1] or not all(device_ready(r) for r in requests):
            return None
        s = self.speculator
        if s.policy is not None and requests:
            k, _ = draft_policy.choose(s.policy, len(requests), s.policy_choices)
            if k == 0:  # plain decoding next: the steady run ends, its last drafts are dropped unverified
                self._plain_next = True
                # the next step is booked under 0; its drafts' pass ran in this step's period
                s.pending_choice, s.pending_draft_seconds, s.pending_captures = 0, 0.0, cuda_graphs.captures
                return None
        return self.context.scheduler.schedule_ahead(requests, self.rows)

    # -- the device's side ------------------------------------------------------------------------
    def _launch(self, scheduled: ScheduledBatch, previous: SpeculativeInFlight | None) -> SpeculativeInFlight:
        rows, clock, runner = self.rows, self.context.clock, self.runner
        device, count = runner.device, len(scheduled)
        requests = scheduled.requests
        self.context.count_step()
        self.launches["following" if previous is not None else "first"] += 1
        self.clock.book()  # a steady run's step before: launch to launch
        s = self.speculator
        s.pending_choice = None  # this step is timed here, not as a synchronous step
        # padded, it verifies the longest drafts
        self.clock.note(count, s.max_drafts, first=previous is None)
        if previous is not None:
            index = {id(r): i for i, r in enumerate(previous.requests)}
            source = to_device(torch.tensor([index[id(r)] for r in requests], dtype=torch.int64), device)
            accepted = previous.outcome.accepted[source]
            positions = previous.positions[source] + accepted + 1
        else:
            source = None
            positions = to_device(torch.tensor([row.start for row in scheduled], dtype=torch.int64), device)
        flags = SamplingFlags.of([r.params for r in requests], runner.vocab_size)
        tail = StepTail(lambda logits, features, inputs: self._tail(logits, features, inputs, flags),
                        self._tail_inputs(requests, previous is None), ("verification", flags))
        step = {}

        def complete(inputs):  # the inputs are where the forward pass reads them: correct them, time from here
            clock.lap("prepare")
            tokens = inputs.token_ids.view(-1, rows)[:count]
            if previous is not None:
                inputs.positions.view(-1, rows)[:count] = positions.unsqueeze(1) + torch.arange(rows, device=device)
                outcome = previous.outcome
                last = outcome.sampled[source].gather(1, accepted.unsqueeze(1))
                tokens.copy_(torch.cat([last, outcome.drafts[source]], dim=1))
                inputs.tail["ints"][_VERIFIED, :count] = outcome.lengths[source]
            step["history"] = self._history(inputs, previous, source, tokens)
            step["started"] = clock.event()

        packed, *logprobs = runner.forward_with_tail(scheduled, tail, complete, values_on_device=previous is not None)
        outcome = _Outcome(packed[:count], rows)
        logprobs = SamplerOutput(None, *(None if t is None else to_host(t[:count * rows]) for t in logprobs))
        clock.lap("forward")
        return SpeculativeInFlight(scheduled, positions, step["history"], outcome, to_host(outcome.packed),
                                   logprobs, step["started"], clock.event())

    def _tail_inputs(self, requests: list[Request], first: bool) -> dict[str, torch.Tensor]:
        """What the step's tail reads per request (``_tail``), padded to the graph's batch: sampling parameters,
        the survival floor, prompt lengths (to number the output positions), the drafts verified (a following
        step's come from the device), the drafter's slots, where each request must end, and (synthetic acceptance)
        each request's key for its draws."""
        s = self.speculator
        pad = self.runner.graphs.padded_requests(len(requests)) - len(requests)

        def padded(values: list, fill) -> list:  # the graph's padding requests: nothing to verify
            return values + [fill] * pad

        floor = s.floor(len(requests))
        floor = 0.0 if floor is None else floor
        floats, ints = padded_sampling_rows(requests, pad)
        floats.append(padded([floor] * len(requests), floor))
        ints += [padded([r.num_drafts if first else 0 for r in requests], 0),
                 padded(s.drafter.device_slots(requests), -1), padded([s.end(r) for r in requests], 0),
                 padded([synthetic_key(r) for r in requests] if s.synthetic_rate is not None else [0] * len(requests),
                        0)]
        return {"floats": torch.from_numpy(np.array(floats, dtype=np.float32)),
                "ints": torch.from_numpy(np.array(ints, dtype=np.int64))}

    def _tail(self, logits: torch.Tensor, features: torch.Tensor | None, inputs, flags: SamplingFlags
              ) -> tuple[torch.Tensor | None, ...]:
        """After the forward pass, on the device for every (padded) request: sample every row, count the accepted
        drafts (or draw them: synthetic acceptance), let the drafter store the kept rows and draft from the new last
        token, size the next step's verification. Returns ``_Outcome.pack``'s tensor and the sampler's logprob outputs."""
        rows, s = self.rows, self.speculator
        temperature, top_p, min_p, floor = inputs.tail["floats"]
        top_k, seeds, prompt_lengths, verified, slots, ends, keys = inputs.tail["ints"]
        tokens, positions = inputs.token_ids.view(-1, rows), inputs.positions.view(-1, rows)

        def each_row(t):
            return t.unsqueeze(1).expand(-1, rows).flatten()

        # a row at position p samples output position p + 1 - the prompt's length
        sampling = sampling_batch(each_row(temperature), each_row(top_k), each_row(top_p), each_row(min_p),
                                  each_row(seeds), (positions + 1 - prompt_lengths.unsqueeze(1)).flatten(), flags)
        sampler_output = self.runner.sampler.sample(logits, sampling)
        sampled = sampler_output.token_ids.view(-1, rows)
        first = positions[:, 0]
        if s.synthetic_rate is None:
            accepted = accepted_counts(tokens[:, 1:], sampled, verified)
        else:  # benchmarks only: drawn on the device from the keys and positions, as the synchronous steps draw
            accepted = s.synthetic_counts(keys, first, verified)
            sampled = drafts_in_accepted_rows(sampled, tokens[:, 1:], accepted)
        kept = accepted + 1
        drafts, confidence = s.drafter.propose_on_device(slots, first, rows, kept, sampled, features)
        # the new last token sits at position first + kept
        room = draft_room(ends, first + kept + 1).clamp_max(min(s.max_drafts, drafts.shape[1]))
        lengths = verified_lengths(room, confidence, floor if s.confidence_scheduling else None)
        width = rows - 1
        drafts = torch.nn.functional.pad(drafts[:, :width], (0, max(0, width - drafts.shape[1])))
        return (_Outcome.pack(sampled, drafts, accepted, verified, lengths), sampler_output.logprobs,
                sampler_output.top_logprob_ids, sampler_output.top_logprobs)

    def _history(self, inputs, previous, source, tokens) -> torch.Tensor | None:
        """Engram's token history: each request's ``h`` ids before its first row, then its rows' ids; for a
        following step, taken from the previous step's at the new first position, and written into its inputs."""
        history = inputs.extras.get("engram_history")
        if history is None:
            return None
        h, rows, count = history.shape[1], self.rows, tokens.shape[0]
        per_row = history.view(-1, rows, h)[:count]
        if previous is None:
            return torch.cat([per_row[:, 0], tokens], dim=1)
        before = previous.history[source]  # position p of the previous step sits at column h + p - its start
        first = previous.outcome.accepted[source] + 1  # the new first position, as a column less h
        ids = torch.cat([before.gather(1, first.unsqueeze(1) + torch.arange(h, device=tokens.device)), tokens], 1)
        per_row.copy_(ids.unfold(1, h, 1)[:, :rows])
        return ids

    # -- the host's side --------------------------------------------------------------------------
    def _resolve(self, inflight: SpeculativeInFlight, keep_drafts: bool = True) -> list[Request]:
        """Books ``inflight``'s result as the engine's synchronous verification would: stats, tokens and stops,
        progress, and each request's drafts for its next step (none where ``keep_drafts`` is False: the policy
        chose plain decoding)."""
        context = self.context
        packed, logprobs = inflight.wait(context.clock)
        rows = [_Outcome.unpack(row, self.rows) for row in packed]
        sampled = host_lists(logprobs)
        sampled["token_ids"] = [token for row in rows for token in row[0]]
        now, finished, kept = time.monotonic(), [], {}
        policy = self.speculator.policy
        if policy is not None:
            # every request of a padded step may verify the longest drafts (less its own cuts)
            draft_policy.record_acceptance(policy, self.speculator.max_drafts, [
                row[2] for request, row in zip(inflight.requests, rows) if not request.finished])
        for i, (request, (_, drafts, accepted, verified, length)) in enumerate(zip(inflight.requests, rows)):
            if request.finished:  # found finished by the step before, while this one was in flight
                continue
            if verified:
                self.speculator.stats.record(request, verified, accepted)
            request.drop_drafts()
            first = i * self.rows
            kept[request] = accepted
            if context.outputs.extend(request, list(range(first, first + accepted + 1)), sampled, now):
                finished.append(request)
                continue
            if keep_drafts:
                request.set_drafts(drafts[:length])
        context.scheduler.update(inflight.batch, kept, finished)
        context.count_finished(finished)
        context.clock.lap("outputs")
        return finished


def _plain(scheduled: ScheduledBatch) -> bool:
    """One row per request, sampled, no drafts: a step a plain run may launch."""
    return all(row.decodes and row.count == 1 for row in scheduled)
