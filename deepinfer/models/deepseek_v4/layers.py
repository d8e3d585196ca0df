"""Small building blocks shared by the DeepSeek-V4 modules: norms and interleaved RoPE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in fp32; the weight stays fp32 and the result takes the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel on CUDA instead of seven (the arithmetic is the same)
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rotary:
    """Interleaved (GPT-J) RoPE on the trailing ``rope_dim`` channels of each head.

    Pairs are (x[2i], x[2i+1]) inside the rope slice; the leading channels are left alone.
    """

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.float()
        self.rope_dim = 2 * inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:  # moved once, outside any CUDA-graph capture
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], inverse: bool = False) -> torch.Tensor:
        """``x`` is [T, ..., D]; cos/sin are [T, rope_dim/2]."""
        cos, sin = cos_sin
        if inverse:
            sin = -sin
        extra_dims = x.dim() - 2
        shape = (cos.shape[0],) + (1,) * extra_dims + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -self.rope_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.rope_dim], rotated.to(x.dtype)], dim=-1)
