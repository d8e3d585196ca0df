"""Plain-torch math shared by the model and the reference plugins."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.core.quantization import blockwise_linear


def project(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, activation_block: int) -> torch.Tensor:
    """``x W^T`` in fp32 for a float weight (upcast) or a quantized one (``blockwise_linear``)."""
    if scale is None:
        return x.float() @ weight.float().T
    return blockwise_linear(x.float(), weight, scale, activation_block)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in fp32: ``silu(min(gate, L)) * clamp(up, -L, L)``."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(min=-limit, max=limit)
