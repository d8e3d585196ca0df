"""Continuous batching with chunked prefill and preemption by recomputation.

Each step has a token budget. Running requests go first, in arrival order, each taking the
tokens it still has to compute (one for a decoding request, a chunk for a prefilling one).
When a request cannot get cache blocks, the most recently admitted running request is
preempted: its blocks are released (the full ones stay in the prefix cache) and it goes back
to the front of the queue to recompute its prompt and everything it generated. Waiting
requests are admitted, oldest first, while budget, sequence slots and blocks remain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer.core.block_manager import BlockManager
from deepinfer.core.request import Request, Status


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

    def schedule(self) -> list[tuple[Request, int, int]]:
        """The (request, first position, token count) triples of the next step."""
        budget = self.limits.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []
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
                scheduled.append((request, request.num_computed, count))
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
            scheduled.append((request, request.num_computed, count))
            budget -= count
        return scheduled

    def _generated_all(self, request: Request) -> bool:
        """Its last token is already being computed (asynchronous scheduling): another step would be wasted."""
        limit = self.limits.max_model_len
        return (request.num_output_tokens >= request.params.max_tokens
                or (limit is not None and len(request.token_ids) >= limit))

    def _attach_cached_prefix(self, request: Request) -> None:
        size = self.blocks.block_size
        hashes = self.blocks.block_hashes(request.token_ids, (len(request.token_ids) - 1) // size, request.block_hashes)
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

    def step_done(self, scheduled: list[tuple[Request, int, int]]) -> None:
        """Record progress, offer full blocks to the prefix cache, release what is no longer read."""
        for request, start, count in scheduled:
            request.num_computed = start + count
            num_full = request.num_computed // self.blocks.block_size
            # only a step that filled a block has one to offer: the others (most decode steps) skip the table walk
            if self.blocks.prefix_caching and num_full > start // self.blocks.block_size:
                hashes = self.blocks.block_hashes(request.token_ids, num_full, request.block_hashes)
                # a replayed prefill's window rows are not what a full one computes (its decoder layers skipped the
                # rows before the replay start and saw windows cut there): they stay out of the prefix cache
                self.blocks.publish(request.tables, hashes, request.num_computed, windows=not request.replay_start)
            self.blocks.trim(request.tables, request.num_computed)

    def finish(self, request: Request) -> None:
        # with asynchronous scheduling a request may be found finished after it was preempted (back in the queue)
        (self.running if request.status is Status.RUNNING else self.waiting).remove(request)
        request.status = Status.FINISHED
        self.blocks.free(request.tables)
