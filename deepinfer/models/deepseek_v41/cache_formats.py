"""The number formats V4.1 keeps its caches in, applied as quantize-then-dequantize.

The released model stores window KV as FP8 (one power-of-two scale per 32 channels), compressed KV as NVFP4 (an
e4m3 scale per 16 channels) and indexer queries/keys as MXFP4 (a power-of-two scale per 32 channels). Its results
depend on that rounding, so the reference path rounds exactly the same way and stores the dequantized values;
packed storage belongs to the kernel backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.core.quantization import E2M1_MAX, E4M3_MAX, _pow2_ceil

_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    return F.pad(x.float(), (0, -x.shape[-1] % block)).unflatten(-1, (-1, block))


def _ungroup(groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return groups.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


def round_fp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    groups = _groups(x, block)
    scale = _pow2_ceil(groups.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1 / E4M3_MAX))
    codes = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return _ungroup(codes * scale, x)


def _round_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value; an exact midpoint goes to the level with the even code."""
    magnitude = scaled.abs().contiguous()
    midpoints = magnitude.new_tensor(_E2M1_MIDPOINTS)
    level = torch.bucketize(magnitude, midpoints)
    on_midpoint = magnitude == midpoints[level.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    level = level + (on_midpoint & (level % 2 == 1)).to(level.dtype)
    return torch.copysign(magnitude.new_tensor(_E2M1_LEVELS)[level], scaled)


def round_mxfp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    groups = _groups(x, block)
    scale = _pow2_ceil(groups.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
    return _ungroup(_round_e2m1((groups / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, x)


def round_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    groups = _groups(x, block)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = (amax.clamp_min(E2M1_MAX * 2**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()
    return _ungroup(_round_e2m1((groups / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, x)
