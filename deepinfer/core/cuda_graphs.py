"""Decode steps replayed from CUDA graphs: one launch per step instead of hundreds of small kernels.

A graph fixes every shape, so a decode batch is padded to the next captured batch size and its compressed-entry
candidates to a power-of-two context bucket (``PaddedShape``). A graph is captured the first time its (batch size,
context) bucket comes up, right after an eager run of the same inputs: that run tunes the Triton kernels outside
the capture and writes exactly the cache rows the replay then rewrites. All graphs share one memory pool, which
is safe because they never run concurrently and each keeps its own static inputs and outputs. The graph stops at
the model's last hidden state: the head runs eagerly on the real rows only, so no graph holds a [batch, vocab]
logits buffer (hundreds of MB each for the larger buckets) and padded rows cost no head GEMM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.core.forward_batch import ForwardBatch, ForwardBatchBuilder, PaddedShape
from deepinfer.core.kv_cache import KVCache
from deepinfer.logger import init_logger

logger = init_logger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
MIN_CONTEXT = 256


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: ForwardBatch
    hidden: torch.Tensor  # the model's output rows for sampling, [padded batch, ...]


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, builder: ForwardBatchBuilder, max_batch: int, max_model_len: int,
                 capture: bool = True):
        self.model, self.cache, self.builder = model, cache, builder
        self.capture = capture  # False runs the padded batches eagerly: how CPU tests check the padding
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [min(max_batch, BATCH_SIZES[-1])]
        self.max_model_len = max_model_len
        self.ratios = list(model.compressed_ratios())
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, scheduled) -> bool:
        """Decode steps only (one new token per request) and no more requests than the largest graph."""
        return len(scheduled) <= self.sizes[-1] and all(n == 1 and start + 1 == len(r.token_ids)
                                                       for r, start, n in scheduled)

    def _shape(self, scheduled) -> PaddedShape:
        size = next(s for s in self.sizes if s >= len(scheduled))
        longest = max(start + 1 for _, start, _ in scheduled)
        context = min(max(MIN_CONTEXT, 1 << (longest - 1).bit_length()), self.max_model_len)
        return PaddedShape(size, {r: -(-context // r) for r in self.ratios}, self.cache.scratch_rows)

    def logits(self, scheduled) -> torch.Tensor:
        """Next-token logits [len(scheduled), V]."""
        shape = self._shape(scheduled)
        if not self.capture:
            return self.model.compute_logits(self._forward(self.builder.build(scheduled, shape))[: len(scheduled)])
        key = (shape.num_tokens, max(shape.candidates.values(), default=0))
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(self.builder.build(scheduled, shape))
        else:
            captured.inputs.copy_(self.builder.build(scheduled, shape, on_host=True))
        captured.graph.replay()
        return self.model.compute_logits(captured.hidden[: len(scheduled)])

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.cache)[batch.logits_rows]

    def _capture(self, batch: ForwardBatch) -> _Captured:
        start = time.perf_counter()
        self._forward(batch)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(batch)
        logger.info("captured a decode CUDA graph: batch %d, candidates %s, in %.2f s", batch.token_ids.shape[0],
                    {r: m.candidates.shape[1] for r, m in batch.compressed.items()}, time.perf_counter() - start)
        return _Captured(graph, batch, hidden)
