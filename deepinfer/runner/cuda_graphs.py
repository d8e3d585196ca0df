"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds of small kernels.

A graph fixes every shape, so a decode batch is padded to the next captured batch size and its block tables and
compressed-entry candidates to a power-of-two context bucket (``PaddedShape``). The graph's static inputs are the
step's host inputs (``StepInputs``); deriving the slots from them is part of the captured work. A graph is
captured the first time its (batch size, context) bucket comes up, right after an eager run of the same inputs:
that run tunes the Triton kernels outside the capture and writes exactly the cache rows the replay then rewrites.
All graphs share one memory pool, which is safe because they never run concurrently and each keeps its own static
inputs and outputs. The graph stops before the vocabulary projection (the final collapse and norm are in it, a
dozen small kernels): the projection runs eagerly on the real rows only, so no graph holds a [batch, vocab] logits
buffer (hundreds of MB each for the larger buckets) and padded rows cost no head GEMM. A step with a tail
(``StepTail``: overlapped speculative decoding's sampling, acceptance and drafting) is the exception: its graph
projects every row and runs the tail, so the host launches the whole step with one replay (the logits and the
sampler's [rows, vocab] intermediates then live in the shared pool, sized by the largest such graph).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from deepinfer.runner.forward_batch import ForwardBatchBuilder
from deepinfer.runtime.kv_cache import KVCache
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runner.step_inputs import PaddedShape, StepInputs, real_rows
from deepinfer.runtime.transfer import to_device
from deepinfer.logger import init_logger

logger = init_logger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
MIN_CONTEXT = 256


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs  # static, on the device
    # what the replay leaves: (final hidden rows [padded batch, hidden], the model's per-token features or None),
    # or a ``StepTail``'s outputs
    outputs: tuple
    # ``inputs`` are views into one device buffer, ``staging`` into one pinned host buffer of the same layout: a
    # step fills the staging views and moves them with one copy. The event follows that copy: a step overwrites
    # the staging buffer only once the previous step's copy has run (usually long done: it preceded the step now
    # running)
    inputs_buffer: torch.Tensor
    staging: StepInputs
    staging_buffer: torch.Tensor
    staged: torch.cuda.Event

    def stage(self, inputs: StepInputs) -> None:
        self.staged.synchronize()
        self.staging.copy_(inputs)
        self.inputs_buffer.copy_(self.staging_buffer, non_blocking=True)
        self.staged.record()


@dataclass(slots=True)
class StepTail:
    """Device work captured with a padded step, after its forward pass: ``run(logits [padded rows, vocab],
    features [padded rows, F] or None, inputs) -> tensors``, ``features`` being the forward's ``ModelOutput``'s. ``run`` reads its own per-step values from ``inputs.tail`` (static in the graph), which the
    step's one staging copy carries from ``inputs`` (host tensors, one column per padded request). Steps whose
    tails share a ``key`` (and the forward's shape) replay one graph: the key holds every host value ``run``
    branches on. ``one_row``: the step has one row a request (speculative decoding's plain steps), not the graphs'
    ``tokens_per_request``."""

    run: Callable[[torch.Tensor, torch.Tensor | None, StepInputs], tuple[torch.Tensor, ...]]
    inputs: dict[str, torch.Tensor]
    key: Hashable
    one_row: bool = False


# graphs captured in this process so far: a step during which this changed spent seconds capturing (and tuning), so
# its time says nothing of what replaying it costs (the measured draft policy books no such step)
captures = 0


def capture_graph(run, pool, what: str) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run()`` once eagerly (it tunes the Triton kernels outside the capture, and writes what the replay then
    rewrites), then captured into a graph allocating from ``pool``; returns the graph and ``run``'s outputs,
    which each replay rewrites."""
    global captures
    captures += 1
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
    except RuntimeError as exc:  # a backend that syncs or allocates on the host despite its graph_safe flag
        raise RuntimeError(f"capturing {what} failed: {exc}. Pass enforce_eager=True to run it eagerly, and "
                           "report it") from exc
    return graph, outputs


class DecodeGraphs:
    """``tokens_per_request`` > 1: speculative decoding's verification steps (a request's last token and its
    drafts, padded to that many rows)."""

    def __init__(self, model, cache: KVCache, builder: ForwardBatchBuilder, max_batch: int, max_model_len: int,
                 capture: bool = True, tokens_per_request: int = 1):
        self.model, self.cache, self.builder = model, cache, builder
        self.tokens_per_request = tokens_per_request
        self.capture = capture  # False runs the padded batches eagerly: how CPU tests check the padding
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [min(max_batch, BATCH_SIZES[-1])]
        self.max_model_len = max_model_len
        self.ratios = list(model.compressed_ratios())
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # steps run padded, replayed or (``capture=False``) eagerly: what tests count

    def fits(self, scheduled: ScheduledBatch) -> bool:
        """Decode steps only (each request's last token, and its drafts) and no more requests than the largest
        graph. A prefill chunk short enough to fit a verification step's rows is not one: its logits would be
        every row's, where only its last is sampled."""
        q = self.tokens_per_request
        return len(scheduled) <= self.sizes[-1] and all(row.decodes and row.count <= q for row in scheduled)

    def _rows_per_request(self, scheduled: ScheduledBatch, tail: StepTail | None) -> int:
        """A request's rows in this step's graph: one where every request has only its last token (speculative
        decoding's steps without drafts replay a plain step's graph, not a verification step's at the cost of
        ``tokens_per_request`` rows a request) and the tail, if any, is a one-row step's; ``tokens_per_request``
        otherwise."""
        one_row = all(row.count == 1 for row in scheduled)
        if tail is not None and tail.one_row and not one_row:
            raise ValueError("a one-row step's tail was given a step with more than one row for a request")
        return 1 if one_row and (tail is None or tail.one_row) else self.tokens_per_request

    def _shape(self, scheduled: ScheduledBatch, tail: StepTail | None = None) -> PaddedShape:
        q = self._rows_per_request(scheduled, tail)
        size = self.padded_requests(len(scheduled))
        longest = max(row.start + q for row in scheduled)  # the padding rows' positions too
        context = 1 << (longest - 1).bit_length()
        if q == 1:
            context = min(max(MIN_CONTEXT, context), self.max_model_len)
        else:  # padding rows may sit past max_model_len: the bucket must still cover them
            context = max(MIN_CONTEXT, context)
        blocks = -(-context // self.builder.layout.block_size)
        return PaddedShape(size * q, blocks, {r: -(-context // r) for r in self.ratios},
                           self.cache.scratch_rows, q)

    def logits(self, scheduled: ScheduledBatch, before_launch=lambda inputs: None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Next-token logits of the scheduled tokens and their features (``ModelOutput.features``), in step order.
        ``before_launch`` gets the step's inputs
        (``StepInputs``) where the forward pass will read them, before it runs (asynchronous scheduling completes
        them there)."""
        hidden, features = self._replay(scheduled, before_launch, False, None)
        return self._real_rows(scheduled, hidden, features)

    def with_tail(self, scheduled: ScheduledBatch, tail: StepTail, before_launch, values_on_device: bool
                  ) -> tuple[torch.Tensor, ...]:
        """The step's forward pass, the vocabulary projection of every row (padding included) and ``tail``, as
        one graph: returns ``tail.run``'s outputs, the graph's own tensors (its next replay rewrites them).
        ``values_on_device``: see ``ForwardBatchBuilder.inputs``."""
        return self._replay(scheduled, before_launch, values_on_device, tail)

    def padded_requests(self, requests: int) -> int:
        """The batch size of the graph that runs ``requests`` requests."""
        return next(s for s in self.sizes if s >= requests)

    def _replay(self, scheduled: ScheduledBatch, before_launch, values_on_device: bool, tail: StepTail | None):
        self.steps += 1
        shape = self._shape(scheduled, tail)
        inputs = self.builder.inputs(scheduled, shape, values_on_device)
        if tail is not None:
            inputs.tail = tail.inputs
        run = self._forward if tail is None else lambda step: tail.run(*self._all_logits(step), step)
        if not self.capture:
            inputs = inputs.to(self.builder.device)
            before_launch(inputs)
            return run(inputs)
        key = (shape.num_tokens, shape.tokens_per_request, shape.blocks, None if tail is None else tail.key)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(inputs, before_launch, run)
        else:
            captured.stage(inputs)
            before_launch(captured.inputs)
        captured.graph.replay()
        return captured.outputs

    def _real_rows(self, scheduled: ScheduledBatch, hidden: torch.Tensor, features: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The real rows' logits and features, in step order. One token per request: a slice, no index to copy
        in the decode step."""
        q = hidden.shape[0] // self.padded_requests(len(scheduled))  # the replayed graph's rows a request
        rows = slice(0, len(scheduled)) if q == 1 else to_device(real_rows(scheduled, q), hidden.device)
        return self.model.project_vocab(hidden[rows]), None if features is None else features[rows]

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's final hidden state, and the model's per-token features when it keeps any."""
        batch = self.builder.derive(inputs)
        output = self.model(batch, self.cache)
        return self.model.final_hidden(output.hidden[batch.logits_rows]), output.features

    def _all_logits(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, features = self._forward(inputs)
        return self.model.project_vocab(hidden), features

    def _capture(self, host_inputs: StepInputs, before_launch, run) -> _Captured:
        start = time.perf_counter()
        staging_buffer, staging = host_inputs.packed_like("cpu", pin_memory=True)
        inputs_buffer, inputs = host_inputs.packed_like(self.builder.device)
        captured = _Captured(None, inputs, None, inputs_buffer, staging, staging_buffer, torch.cuda.Event())
        captured.stage(host_inputs)
        before_launch(inputs)
        captured.graph, captured.outputs = capture_graph(
            lambda: run(inputs), self.pool, f"the decode CUDA graph (batch {inputs.token_ids.shape[0]})")
        logger.info("captured a decode CUDA graph: batch %d, candidates %s%s, in %.2f s", inputs.token_ids.shape[0],
                    inputs.candidates, " with its step's tail" if host_inputs.tail else "",
                    time.perf_counter() - start)
        return captured
