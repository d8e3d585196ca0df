"""V4.1's RoPE and single-pass mHC.

RoPE rotates the trailing ``rope_dim`` channels as complex pairs, the way the released model does: the rounding of
that product decides which FP8/FP4 bin the cached values fall into, so it is reproduced as is.

Single-pass mHC: every sublayer predicts its own (pre, post, comb) from the streams it receives, but collapses
those streams with the ``pre`` of the sublayer before it; the last ``pre`` collapses the streams for the head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.models.deepseek_v4.layers import unit_phases
from deepinfer.plugins.interfaces import MHCBackend


class ComplexRotary:
    """V4.1's RoPE (interleaved pairs, optional YaRN on the compressed path), applied by the attention backend."""

    def __init__(self, config, compressed: bool, backend):
        dim = config.rope_head_dim
        theta = config.compress_rope_theta if compressed else config.rope_theta
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
        yarn = config.yarn if compressed else None
        if yarn is not None:
            def pair_index(rotations: float) -> float:
                return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

            low = max(math.floor(pair_index(yarn.beta_fast)), 0)
            high = min(math.ceil(pair_index(yarn.beta_slow)), dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
            freqs = freqs / yarn.factor * ramp + freqs * (1 - ramp)
        self.freqs, self.ones = freqs, torch.ones_like(freqs)
        self.rope_dim = dim
        self.backend = backend

    def phases(self, positions: torch.Tensor) -> torch.Tensor:
        """Unit complex numbers ``[T, rope_dim/2]``."""
        if self.freqs.device != positions.device:  # moved once, outside any CUDA-graph capture
            self.freqs, self.ones = self.freqs.to(positions.device), self.ones.to(positions.device)
        return unit_phases(positions, self.freqs, self.ones)

    def apply(self, x: torch.Tensor, phases: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.backend.rotate(x, phases, self.rope_dim, inverse)


class MixPredictor(nn.Module):
    """One sublayer's mHC coefficients (``pre`` [T, n], ``post`` [T, n], ``comb`` [T, n, n], all fp32) and its
    input, collapsed with the previous sublayer's ``pre``."""

    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 backend: MHCBackend):
        super().__init__()
        n = self.hc_mult = hc_mult
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps
        self.backend = backend
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def enter(self, streams: torch.Tensor, previous_pre: torch.Tensor, norm):
        """The sublayer's input (the streams collapsed with ``previous_pre``, then ``norm``) and its own coefficients:
        (input, pre, post, comb)."""
        return self.backend.single_pass_input(streams, previous_pre, self.fn, self.base, self.scale, self.hc_mult,
                                              self.sinkhorn_iters, self.hc_eps, self.norm_eps, norm.weight, norm.eps)
