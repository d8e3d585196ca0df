"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds of small kernels.

A graph fixes every shape, so a decode batch is padded to the next captured batch size and its block tables and
compressed-entry candidates to a power-of-two context bucket (``PaddedShape``). The graph's static inputs are the
step's host inputs (``StepInputs``); deriving the slots from them is part of the captured work. A graph is
captured the first time its (batch size, context) bucket comes up, right after an eager run of the same inputs:
that run tunes the Triton kernels outside the capture and writes exactly the cache rows the replay then rewrites.
All graphs share one memory pool, which is safe because they never run concurrently and each keeps its own static
inputs and outputs. The graph stops before the vocabulary projection (the final collapse and norm are in it, a
dozen small kernels): the projection runs eagerly on the real rows only, so no graph holds a [batch, vocab] logits
buffer (hundreds of MB each for the larger buckets) and padded rows cost no head GEMM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.core.forward_batch import ForwardBatchBuilder, PaddedShape, StepInputs, real_rows
from deepinfer.core.kv_cache import KVCache
from deepinfer.core.transfer import to_device
from deepinfer.logger import init_logger

logger = init_logger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
MIN_CONTEXT = 256


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: StepInputs  # static, on the device
    hidden: torch.Tensor  # the final hidden rows the vocabulary projection reads, [padded batch, hidden]
    features: torch.Tensor | None  # the model's per-token features (a drafter's input), when it keeps any
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


def capture_graph(run, pool, what: str) -> tuple[torch.cuda.CUDAGraph, object]:
    """``run()`` once eagerly (it tunes the Triton kernels outside the capture, and writes what the replay then
    rewrites), then captured into a graph allocating from ``pool``; returns the graph and ``run``'s outputs,
    which each replay rewrites."""
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
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, scheduled) -> bool:
        """Decode steps only (each request's last token, and its drafts) and no more requests than the largest
        graph."""
        q = self.tokens_per_request
        return len(scheduled) <= self.sizes[-1] and all(n <= q and start + n == len(r.token_ids)
                                                       for r, start, n in scheduled)

    def _shape(self, scheduled) -> PaddedShape:
        q = self.tokens_per_request
        size = next(s for s in self.sizes if s >= len(scheduled))
        longest = max(start + q for _, start, _ in scheduled)  # the padding rows' positions too
        context = 1 << (longest - 1).bit_length()
        if q == 1:
            context = min(max(MIN_CONTEXT, context), self.max_model_len)
        else:  # padding rows may sit past max_model_len: the bucket must still cover them
            context = max(MIN_CONTEXT, context)
        blocks = -(-context // self.builder.layout.block_size)
        return PaddedShape(size * q, blocks, {r: -(-context // r) for r in self.ratios},
                           self.cache.scratch_rows, q)

    def logits(self, scheduled, before_launch=lambda inputs: None, every_row: bool = False,
               values_on_device: bool = False) -> torch.Tensor:
        """Next-token logits of the scheduled tokens, in step order. ``before_launch`` gets the step's inputs
        (``StepInputs``) where the forward pass will read them, before it runs (asynchronous scheduling completes
        them there). ``every_row``: all ``tokens_per_request`` rows of each scheduled request, padding included
        ([requests * tokens_per_request]); ``values_on_device``: see ``ForwardBatchBuilder.inputs``."""
        shape = self._shape(scheduled)
        inputs = self.builder.inputs(scheduled, shape, values_on_device)
        rows = slice(0, len(scheduled) * self.tokens_per_request) if every_row else None
        if not self.capture:
            inputs = inputs.to(self.builder.device)
            before_launch(inputs)
            hidden = self._forward(inputs)
            return self._real_rows(scheduled, hidden, getattr(self.model, "features", None), rows)
        key = (shape.num_tokens, shape.blocks)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(inputs, before_launch)
        else:
            captured.stage(inputs)
            before_launch(captured.inputs)
        captured.graph.replay()
        return self._real_rows(scheduled, captured.hidden, captured.features, rows)

    def _real_rows(self, scheduled, hidden: torch.Tensor, features: torch.Tensor | None, rows=None) -> torch.Tensor:
        """The real rows' logits (or ``rows``'), in step order; their features (a drafter's input) go where the
        drafter reads them. One token per request: a slice, no index to copy in the decode step."""
        if rows is None:
            rows = (slice(0, len(scheduled)) if self.tokens_per_request == 1 else
                    to_device(real_rows(scheduled, self.tokens_per_request), hidden.device))
        if features is not None:
            self.model.features = features[rows]
        return self.model.project_vocab(hidden[rows])

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        batch = self.builder.derive(inputs)
        return self.model.final_hidden(self.model(batch, self.cache)[batch.logits_rows])

    def _capture(self, host_inputs: StepInputs, before_launch) -> _Captured:
        start = time.perf_counter()
        staging_buffer, staging = host_inputs.packed_like("cpu", pin_memory=True)
        inputs_buffer, inputs = host_inputs.packed_like(self.builder.device)
        captured = _Captured(None, inputs, None, None, inputs_buffer, staging, staging_buffer, torch.cuda.Event())
        captured.stage(host_inputs)
        before_launch(inputs)
        graph, hidden = capture_graph(lambda: self._forward(inputs), self.pool,
                                      f"the decode CUDA graph (batch {inputs.token_ids.shape[0]})")
        logger.info("captured a decode CUDA graph: batch %d, candidates %s, in %.2f s", inputs.token_ids.shape[0],
                    inputs.candidates, time.perf_counter() - start)
        captured.graph, captured.hidden = graph, hidden
        captured.features = getattr(self.model, "features", None)  # the graph's own output tensor, if any
        return captured
