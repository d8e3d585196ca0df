"""V4.1's cache formats in one launch (``AttentionBackend.round_to_format``): the reference pads, groups, takes
each group's amax, derives its scale with integer tricks, buckets the scaled values onto the e2m1 grid and scales
back, some twenty kernels per call and four calls per V4.1 layer at decode. Here a program rounds whole groups in
registers, bit for bit as ``deepinfer.runtime.cache_formats``: every step is exact in fp32 (power-of-two scales, the
NVFP4 scale's e4m3 rounding and the e2m1 grid done in fp32 arithmetic, the one inexact division correctly rounded),
and each result has at most 7 significant bits, so storing it in bf16 rounds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import _pow2_ceil, _round_to_e4m3, _segment_scale

# format -> (group size, kernel code)
FORMATS = {"fp8": (32, 0), "mxfp4": (32, 1), "nvfp4": (16, 2)}
GROUPS_PER_PROGRAM = 16


@triton.jit
def _round_to_e2m1(v):
    """The e2m1 grid's nearest value (0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code) of ``v`` in [-6, 6]; zero
    without a sign, as the reference's code 0."""
    m = tl.abs(v)
    code = ((m > 0.25).to(tl.int32) + (m > 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + (m > 1.75).to(tl.int32)
            + (m > 2.5).to(tl.int32) + (m > 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    midpoint = (m == 0.25) | (m == 0.75) | (m == 1.25) | (m == 1.75) | (m == 2.5) | (m == 3.5) | (m == 5.0)
    code += (midpoint & (code % 2 == 1)).to(tl.int32)
    value = tl.where(code < 4, code.to(tl.float32) * 0.5,
                     tl.where(code == 4, 2.0, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0))))
    return tl.where((v < 0) & (code > 0), -value, value)


@triton.jit
def _round_kernel(x_ptr, out_ptr, D, stride_x, GROUP: tl.constexpr, GROUPS: tl.constexpr, FORMAT: tl.constexpr):
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * GROUPS + tl.arange(0, GROUPS))[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = cols < D  # a partial last group: its missing channels are zeros, as the reference pads it
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)[:, None]
    if FORMAT == 0:  # FP8: a power-of-two scale, e4m3 values
        scale = _segment_scale(amax)  # as the FP8 GEMMs' activation rounding
        # rounded as a magnitude, the sign bit put back: a negative value rounded to zero stays -0.0 as in torch
        # (Triton's unary minus is a subtraction from +0.0, which would lose it)
        magnitude = _round_to_e4m3(tl.minimum(tl.abs(x) / scale, 448.0))
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        y = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * scale
    elif FORMAT == 1:  # MXFP4: a power-of-two scale, e2m1 values
        scale = _pow2_ceil(tl.maximum(amax, 7.052966104933725e-38) * (1.0 / 6.0))  # the floor: 6 * 2^-126
        y = _round_to_e2m1(tl.clamp(x / scale, -6.0, 6.0)) * scale
    else:  # NVFP4: an e4m3 scale (saturating at 448 as torch's conversion does), e2m1 values
        scale = _round_to_e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0))  # 6 * 2^-9
        y = _round_to_e2m1(tl.clamp(tl.math.div_rn(x, scale), -6.0, 6.0)) * scale
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``AttentionBackend.round_to_format``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; expected one of {sorted(FORMATS)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"round_to_format rounds float32/bfloat16/float16 rows, got {x.dtype}")
    group, code = FORMATS[fmt]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        grid = (rows.shape[0], triton.cdiv(triton.cdiv(width, group), GROUPS_PER_PROGRAM))
        _round_kernel[grid](rows, out, width, rows.stride(0), GROUP=group, GROUPS=GROUPS_PER_PROGRAM, FORMAT=code,
                            **LAUNCH)
    return out
