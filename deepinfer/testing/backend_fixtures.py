"""Small inputs that backend tests share (not part of the public API)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer.runtime.quantization import quantize_fp4, quantize_fp8
from deepinfer.plugins.interfaces import ExpertWeights


def stand_in_ranks(device):
    """What a token-exchange hook reads of ``parallel.ranks.Ranks``: rank 0 of 2 on ``device``, no groups."""
    return SimpleNamespace(rank=0, world_size=2, device=device, device_group=None, control_group=None)


def random_experts(g: torch.Generator, fmt, experts=8, hidden=64, inter=32, limit=1.5) -> ExpertWeights:
    """Stacked routed experts in ``fmt``: a float dtype, ``"mxfp4"`` or FP8 in 32 x 32 tiles (anything else)."""
    def weight(rows, cols):
        return torch.randn(experts, rows, cols, generator=g) * cols ** -0.5

    stacks = [weight(inter, hidden), weight(inter, hidden), weight(hidden, inter)]
    if fmt in (torch.float32, torch.bfloat16):
        return ExpertWeights(*(w.to(fmt) for w in stacks), limit)
    quantize = quantize_fp4 if fmt == "mxfp4" else (lambda w: quantize_fp8(w, 32, 32))
    (w1, s1), (w3, s3), (w2, s2) = ([torch.stack(t) for t in zip(*map(quantize, w))] for w in stacks)
    return ExpertWeights(w1, w3, w2, limit, s1, s3, s2, 32)
