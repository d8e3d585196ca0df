"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` parallel streams."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.models.deepseek_v4.layers import unweighted_rms_norm
from deepinfer.plugins.interfaces import MHCBackend


class HyperConnection(nn.Module):
    """Weights that collapse the streams into a sublayer's input and expand its output back.

    ``pre`` collapses, ``post`` expands, ``comb`` (Sinkhorn-projected to a doubly-stochastic
    matrix) mixes the old streams into the new ones as ``comb^T @ streams``.
    """

    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 backend: MHCBackend):
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.backend = backend
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def collapse(self, streams: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams`` [T, n, D] -> (sublayer input [T, D] normalized by ``norm``, post [T, n], comb [T, n, n])."""
        return self.backend.sublayer_input(streams, self.fn, self.base, self.scale, self.hc_mult, self.sinkhorn_iters,
                                           self.hc_eps, self.norm_eps, norm.weight, norm.eps)

    def expand(self, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        # fp32, rounded once (HF rounds the mix and the update to bf16 separately: within one bf16 step of this)
        return self.backend.expand(streams, output, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the streams before the output norm (no Sinkhorn)."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps) @ self.fn.T
        pre = torch.sigmoid(mix * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
