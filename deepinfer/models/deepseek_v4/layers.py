"""Small building blocks shared by the DeepSeek-V4 modules: norms and interleaved RoPE."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.runtime.ops import rms_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in fp32; the weight stays fp32 and the result takes the input dtype. With an
    attention ``backend`` (attention's norms, the final norm), the backend computes it (``AttentionBackend.rms_norm``);
    norms whose weight another kernel reads (mHC's collapse, the compressor's pooling) have none."""

    def __init__(self, dim: int, eps: float, backend=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is not None:
            return self.backend.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalised ``x`` over its last dim, in fp32, returned in ``x``'s dtype."""
    return rms_norm(x, None, eps)


def unit_phases(positions: torch.Tensor, freqs: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """``exp(i positions x freqs)`` [T, F] in two kernels: the product promotes the integer positions to fp32 itself
    (no cast kernel) and the unit modulus is ``ones`` [F] broadcast (no fill kernel): each rotary runs this every
    decode step."""
    angles = positions.unsqueeze(-1) * freqs
    return torch.polar(ones.expand_as(angles), angles)


class Rotary:
    """Interleaved (GPT-J) RoPE on the trailing ``rope_dim`` channels of each head, applied by the attention backend
    (``AttentionBackend.rotate``; ``deepinfer.runtime.ops.rotate_pairs`` is the reference)."""

    def __init__(self, inv_freq: torch.Tensor, backend):
        self.inv_freq = inv_freq.float()
        self.ones = torch.ones_like(self.inv_freq)
        self.rope_dim = 2 * inv_freq.numel()
        self.backend = backend

    def phases(self, positions: torch.Tensor) -> torch.Tensor:
        """Unit complex numbers ``[T, rope_dim/2]``."""
        if self.inv_freq.device != positions.device:  # moved once, outside any CUDA-graph capture
            self.inv_freq, self.ones = self.inv_freq.to(positions.device), self.ones.to(positions.device)
        return unit_phases(positions, self.inv_freq, self.ones)

    def apply(self, x: torch.Tensor, phases: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.backend.rotate(x, phases, self.rope_dim, inverse)
