"""A drafter's pass replayed from CUDA graphs, one per padded batch size, like the engine's decode steps."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.runner.cuda_graphs import capture_graph
from deepinfer.logger import init_logger

logger = init_logger(__name__)


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, batch]: anchors, positions, slots (static, on the device)
    outputs: tuple[torch.Tensor, ...]  # each [batch, ...]
    # the inputs' pinned host copy, reused: a draft pass ends with its outputs read on the host, so the previous
    # copy from it has run before the next overwrites it
    staging: torch.Tensor


class DraftGraphs:
    """A draft pass ``run(inputs [3, B]: anchor ids, positions, slots) -> tensors [B, ...]`` captured per padded
    batch size, the first time each comes up (after an eager run of the same inputs, which tunes the Triton
    kernels outside the capture); padding rows use the pool's empty slot. ``run`` comes with each call rather than
    being kept: a drafter's bound pass kept here would make the drafter and its graphs a reference cycle, whose
    device memory only a garbage collection frees."""

    def __init__(self, sizes: list[int], empty_slot: int, device: torch.device):
        self.sizes, self.empty_slot, self.device = sizes, empty_slot, device
        self.graphs: dict[int, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def __call__(self, run, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = inputs.shape[1]
        size = next(s for s in self.sizes if s >= batch)
        captured = self.graphs.get(size)
        padded = captured.staging if captured is not None else torch.empty(3, size, dtype=torch.int64, pin_memory=True)
        padded.zero_()
        padded[2] = self.empty_slot
        padded[:, :batch] = inputs
        if captured is None:
            captured = self.graphs[size] = self._capture(run, padded)
        else:
            captured.inputs.copy_(padded, non_blocking=True)
        captured.graph.replay()
        return tuple(t[:batch] for t in captured.outputs)

    def _capture(self, run, host_inputs: torch.Tensor) -> _Captured:
        start = time.perf_counter()
        inputs = host_inputs.to(self.device)
        graph, outputs = capture_graph(lambda: run(inputs), self.pool, f"the draft pass (batch {inputs.shape[1]})")
        logger.info("captured a draft CUDA graph: batch %d, in %.2f s", inputs.shape[1], time.perf_counter() - start)
        return _Captured(graph, inputs, outputs, host_inputs)
