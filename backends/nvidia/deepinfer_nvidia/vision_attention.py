"""The vision tower's attention on the GPU: torch's fused attention kernels (cuDNN's, FlashAttention-2's, the
memory-efficient one), the fastest measured per image size.

The tower attends over every patch of an image (thousands at V4.1-Flash's sizes, 16 heads of 64), so attention is
most of its time. torch's ``scaled_dot_product_attention`` picks a kernel by a fixed priority; this backend times
each kernel that accepts the call the first time a patch-count bucket (a power of two) is seen, keeps the fastest
and logs the choice. The encoder runs eagerly (no CUDA graph), between decode steps' graphs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepinfer.logger import init_logger, log_once

logger = init_logger(__name__)

CANDIDATES = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
TIMED_RUNS = 3


def _attend(q, k, v, kernel: SDPBackend) -> torch.Tensor:
    # [patches, heads, dim] -> [1, heads, patches, dim]: the fused kernels take only batched 4-D inputs
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    with sdpa_kernel(kernel):
        out = F.scaled_dot_product_attention(q, k, v)
    return out[0].transpose(0, 1).flatten(1)


def _time_ms(q, k, v, kernel: SDPBackend) -> float:
    _attend(q, k, v, kernel)  # its first call compiles or plans
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_RUNS):
        _attend(q, k, v, kernel)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_RUNS


class SDPAVisionAttention:
    name = "torch fused attention kernels, fastest measured per image size"

    def __init__(self, candidates=CANDIDATES):
        self.candidates = candidates
        self.chosen: dict[tuple, SDPBackend] = {}

    def attention(self, q, k, v):
        patches, heads, dim = q.shape
        key = (1 << max(patches - 1, 0).bit_length(), heads, dim, q.dtype)
        kernel = self.chosen.get(key)
        if kernel is None:
            kernel = self.chosen[key] = self._fastest(q, k, v, key)
        return _attend(q, k, v, kernel)

    def _fastest(self, q, k, v, key) -> SDPBackend:
        timings, refused = {}, {}
        for kernel in self.candidates:
            try:
                timings[kernel] = _time_ms(q, k, v, kernel)
            except RuntimeError as exc:  # torch: no kernel of this kind takes these inputs (dtype, head size, GPU)
                refused[kernel.name] = str(exc).splitlines()[0][:120]
        if not timings:
            raise RuntimeError(f"vision attention: none of {[k.name for k in self.candidates]} takes {tuple(q.shape)} "
                               f"{q.dtype} on this GPU: {refused}")
        best = min(timings, key=timings.get)
        measured = ", ".join(f"{k.name} {ms:.3f} ms" for k, ms in timings.items())
        log_once(logger, logging.INFO, f"vision attention, up to {key[0]} patches x {key[1]} heads of {key[2]}: "
                                       f"{best.name} ({measured}{'; refused: ' + str(refused) if refused else ''})")
        return best
