"""Continuous batching with chunked prefill and preemption by recomputation.

Each step has a token budget. Running requests go first, in arrival order, each taking the
tokens it still has to compute (one for a decoding request, a chunk for a prefilling one).
When a request cannot get cache blocks, the most recently admitted running request is
preempted: its blocks are released (the full ones stay in the prefix cache) and it goes back
to the front of the queue to recompute its prompt and everything it generated. Waiting
requests are admitted, oldest first, while budget, sequence slots and blocks remain.

The scheduler alone moves a request's progress (``num_computed``) and reserves its cache blocks: a step's
rows go out as a ``ScheduledBatch`` and come back through ``update``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from dataclasses import dataclass

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.runtime.request import Request, Status
from deepinfer.runtime.scheduled import ScheduledBatch, ScheduledRequest
from deepinfer.plugins.interfaces import ComputedRows


@dataclass(slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int | None = None


class Scheduler:
    def __init__(self, limits: SchedulerLimits, blocks: BlockManager):
        self.limits = limits
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """The rows of the next step."""
        budget = self.limits.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._generated_all(request):
                index += 1
                continue
            if request.num_pending > budget and request.num_drafts:  # verify fewer drafts rather than none
                request.drop_drafts(keep=max(0, budget - (request.num_pending - request.num_drafts)))
            count = min(request.num_pending, budget)
            end = request.num_computed + count
            while not self.blocks.reserve(request.tables, request.num_computed, end):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest.of(request, request.num_computed, count))
                budget -= count
                index += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            if not request.tables:
                self._attach_cached_prefix(request)
            count = min(request.num_pending, budget)
            end = request.num_computed + count
            if count < request.num_pending and not self.limits.enable_chunked_prefill:
                break
            if not self.blocks.reserve(request.tables, request.num_computed, end):
                if not self.running and not scheduled:
                    raise RuntimeError(
                        f"request {request.request_id} needs more cache blocks than the whole cache has; "
                        "raise num_cache_tokens or lower max_num_batched_tokens"
                    )
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest.of(request, request.num_computed, count))
            budget -= count
        return ScheduledBatch(scheduled)

    def schedule_ahead(self, requests: list[Request], rows: int) -> ScheduledBatch | None:
        """A verification step of ``requests`` launched before the step in flight is booked (overlapped
        speculative decoding): ``rows`` rows each, at each one's latest possible start (every draft of the step
        in flight accepted), with blocks reserved up to there. None where it cannot go ahead: the running set
        would change (a request waits for a free sequence slot), a request could finish within the step in
        flight, or blocks run out."""
        if (not requests or len(requests) != len(self.running)
                or (self.waiting and len(self.running) < self.limits.max_num_seqs)):
            return None
        for r in requests:
            # ``r`` is booked up to the step in flight's start, which emits at least one token: is one left?
            left = min(r.params.max_tokens - r.num_output_tokens, self.limits.max_model_len - r.num_computed - 1)
            if left < 2:
                return None
        scheduled = []
        for r in requests:
            start = r.num_computed + rows
            if not self.blocks.reserve(r.tables, r.num_computed, start + rows):
                return None
            # every row after the first is a draft or padding: the device counts which it accepts
            scheduled.append(ScheduledRequest(r, start, rows, samples=True, drafts=rows - 1))
        return ScheduledBatch(scheduled)

    def _generated_all(self, request: Request) -> bool:
        """Its last token is already being computed (asynchronous scheduling): another step would be wasted."""
        limit = self.limits.max_model_len
        return (request.num_output_tokens >= request.params.max_tokens
                or (limit is not None and len(request.token_ids) >= limit))

    def _attach_cached_prefix(self, request: Request) -> None:
        size = self.blocks.block_size
        hashes = self.blocks.block_hashes(request.token_ids, (len(request.token_ids) - 1) // size, request.block_hashes,
                                          request.images)
        request.num_computed = self.blocks.match_prefix(request.tables, hashes, len(request.token_ids) - 1)
        request.metrics.num_cached_tokens = request.num_computed

    def _preempt(self, request: Request) -> None:
        request.drop_drafts()  # drafted for the step it will not take
        self.blocks.free(request.tables)
        request.num_computed = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, batch: ScheduledBatch, accepted: Mapping[Request, int] = MappingProxyType({}),
               finished: list[Request] = ()) -> list[ComputedRows]:
        """Books a step: each request still running has computed its rows from where it was booked, except the
        rows of drafts it rejected (``accepted``: how many drafts each request with drafts in the step kept).
        Full blocks go to the prefix cache, blocks no longer read are released; then ``finished`` (the requests
        the step finished) leave, their full blocks offered too (a request that ends with its prefill leaves its
        prompt to the next one). Returns what was booked for the requests that go on, by the step's rows (what a
        drafter keeps). A row's own ``start`` is not used: a step scheduled ahead starts where the step before it
        ends, known only once that one is booked."""
        done, booked, first = {id(r) for r in finished}, [], 0
        for row in batch:
            request = row.request
            ends_here = id(request) in done
            if ends_here or not request.finished:  # not one found finished before this step
                count = row.count - row.drafts + accepted[request] if row.drafts else row.count
                if not ends_here:
                    booked.append(ComputedRows(request, first, request.num_computed, count))
                self._book(request, request.num_computed, count)
            first += row.count
        for request in finished:
            self.finish(request)
        return booked

    def _book(self, request: Request, start: int, count: int) -> None:
        """Record progress, offer full blocks to the prefix cache, release what is no longer read."""
        request.num_computed = start + count
        num_full = request.num_computed // self.blocks.block_size
        # only a step that filled a block has one to offer: the others (most decode steps) skip the table walk
        if self.blocks.prefix_caching and num_full > start // self.blocks.block_size:
            hashes = self.blocks.block_hashes(request.token_ids, num_full, request.block_hashes, request.images)
            # a replayed prefill's window rows are not what a full one computes (its decoder layers skipped the
            # rows before the replay start and saw windows cut there): they stay out of the prefix cache
            self.blocks.publish(request.tables, hashes, request.num_computed, windows=not request.replay_start)
        self.blocks.trim(request.tables, request.num_computed)

    def finish(self, request: Request) -> None:
        # with asynchronous scheduling a request may be found finished after it was preempted (back in the queue)
        (self.running if request.status is Status.RUNNING else self.waiting).remove(request)
        request.status = Status.FINISHED
        self.blocks.free(request.tables)
