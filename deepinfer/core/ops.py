"""Plain-torch math shared by the model and the reference plugins."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in fp32: ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``, returned in fp32."""
    xf = x.float()
    gate = (xf @ w1.float().T).clamp(max=limit)
    up = (xf @ w3.float().T).clamp(min=-limit, max=limit)
    return (F.silu(gate) * up) @ w2.float().T
