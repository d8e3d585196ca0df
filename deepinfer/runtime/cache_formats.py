"""The number formats V4.1 keeps its caches in, applied as quantize-then-dequantize.

The released model stores window KV as FP8 (one power-of-two scale per 32 channels), compressed KV as NVFP4 (an
e4m3 scale per 16 channels) and indexer queries/keys as MXFP4 (a power-of-two scale per 32 channels). Its results
depend on that rounding, so the reference path rounds exactly the same way and stores the dequantized values;
packed storage belongs to the kernel backends. ``round_to_format`` is the reference of
``AttentionBackend.round_to_format``, through which the model rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.runtime.quantization import E2M1_MAX, E2M1_VALUES, _pow2_ceil, constant, e2m1_codes, round_fp8


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    return F.pad(x.float(), (0, -x.shape[-1] % block)).unflatten(-1, (-1, block))


def _ungroup(groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return groups.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


def _round_e2m1(scaled: torch.Tensor) -> torch.Tensor:
    return constant(E2M1_VALUES, scaled.dtype, scaled.device)[e2m1_codes(scaled)]


def round_mxfp4(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    groups = _groups(x, block)
    scale = _pow2_ceil(groups.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
    return _ungroup(_round_e2m1((groups / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, x)


def round_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    groups = _groups(x, block)
    amax = groups.abs().amax(-1, keepdim=True)
    # clamped before the cast: torch's e4m3 conversion saturates at 448 on a CPU but gives NaN past 480 on CUDA
    scale = (amax.clamp_min(E2M1_MAX * 2**-9) / E2M1_MAX).clamp_max(448.0).to(torch.float8_e4m3fn).float()
    return _ungroup(_round_e2m1((groups / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, x)


CACHE_FORMATS = {
    "fp8": lambda x: round_fp8(x, 32),
    "mxfp4": round_mxfp4,
    "nvfp4": round_nvfp4,
}


def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` [..., D] rounded to ``fmt`` along its last dim (see the module's docstring), in ``x``'s dtype."""
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {sorted(CACHE_FORMATS)}")
    return CACHE_FORMATS[fmt](x)
