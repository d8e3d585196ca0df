"""Activations rounded to FP8 e4m3 in Triton, one power-of-two scale per ``1 x block`` segment, bit-exact with
``deepinfer.runtime.quantization.round_fp8``: what the FP8 GEMMs (``fp8_linear``) and the MXFP4 experts (``moe``) read,
and the rounding helpers the FP8 caches' kernels share (``cache_formats``, ``kv_store``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

@triton.jit
def _pow2_ceil(v):
    """Smallest power of two >= v (v > 0): bump the exponent when any mantissa bit is set."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(v):
    """e4m3's nearest value (ties to even) of ``v`` in [-448, 448], in fp32 arithmetic.

    The interpreter's fp32 -> e4m3 conversion rounds ties away and mishandles carries into the exponent, so off the
    GPU the rounding is done here and the conversion only stores values that are already exact.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # 1.5 * 2^14: fp32 spacing there is 2^-9, e4m3's subnormal step
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _segment_scale(amax):
    """The power-of-two scale of a 1 x BK segment with largest magnitude ``amax``."""
    return _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))


@triton.jit
def _e4m3_values(x, scale, NATIVE_FP8: tl.constexpr):
    """``x / scale`` as e4m3 values (still fp32; exact once converted)."""
    q = tl.clamp(x / scale, -448.0, 448.0)
    if not NATIVE_FP8:
        q = _round_to_e4m3(q)
    return q


@triton.jit(do_not_specialize=["M"])  # counts of a step's rows: one binary for any
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, num_blocks, up_ptr, stride_up, limit,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr, SEGMENTS: tl.constexpr, NATIVE_FP8: tl.constexpr,
                      ROUND_TRIP: tl.constexpr = False, PAIRS_APART: tl.constexpr = False,
                      SWIGLU: tl.constexpr = False):
    """ROWS rows x SEGMENTS segments of BLOCK columns per program, each segment scaled on its own. ROUND_TRIP:
    ``q`` gets the rounded values times their scales, in its own dtype (exact in bf16), and no scales.
    PAIRS_APART: each 32 columns of ``q`` hold their even columns, then their odd ones (what the MXFP4 experts'
    MMAs read: a packed weight byte holds an even and an odd column's codes). SWIGLU: ``x`` is the gate, and the
    values rounded are ``swiglu(x, up)`` in fp32, as ``activation.swiglu`` computes them."""
    wait_for_inputs()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    segments = tl.program_id(1) * SEGMENTS + tl.arange(0, SEGMENTS)
    offs = segments[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [SEGMENTS, BLOCK] columns
    rows_ok = rows < M
    mask = rows_ok[:, None, None] & (offs < K)[None, :, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None, None] * stride_x + offs[None, :, :], mask=mask,
                other=0.0).to(tl.float32)
    if SWIGLU:
        up = tl.load(up_ptr + rows.to(tl.int64)[:, None, None] * stride_up + offs[None, :, :], mask=mask,
                     other=0.0).to(tl.float32)
        x = tl.minimum(x, limit)
        x = x * tl.sigmoid(x) * tl.minimum(tl.maximum(up, -limit), limit)
    scale = _segment_scale(tl.max(tl.abs(x), axis=2))  # [ROWS, SEGMENTS]
    q = _e4m3_values(x, scale[:, :, None], NATIVE_FP8).to(tl.float8e4nv)
    if ROUND_TRIP:
        q = q.to(tl.float32) * scale[:, :, None]
    stored = (offs // 32) * 32 + (offs % 2) * 16 + (offs % 32) // 2 if PAIRS_APART else offs
    tl.store(q_ptr + rows.to(tl.int64)[:, None, None] * stride_q + stored[None, :, :], q.to(q_ptr.dtype.element_ty),
             mask=mask)
    if not ROUND_TRIP:
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * num_blocks + segments[None, :], scale,
                 mask=rows_ok[:, None] & (segments < num_blocks)[None, :])


# act_quant's tile: about 4096 values a program, 512 while there are few rows (a decode step's: its few programs
# stay spread over the SMs). A program per (row, segment), as first written, ran V4.1's 32-column segments as
# millions of 32-value programs in a prefill (52 ms over 58 calls at 8192 tokens).
ACT_QUANT_VALUES, ACT_QUANT_VALUES_FEW_ROWS, ACT_QUANT_FEW_ROWS = 4096, 512, 64


@functools.cache  # asked twice per projection per step; the answer never changes
def _native_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _act_quant(x: torch.Tensor, block: int, q: torch.Tensor, scales: torch.Tensor | None,
               pairs_apart: bool = False, up: torch.Tensor | None = None, limit: float = 0.0) -> None:
    rows, cols = x.shape
    num_blocks = triton.cdiv(cols, block)
    if not rows:
        return
    values = ACT_QUANT_VALUES if rows > ACT_QUANT_FEW_ROWS else ACT_QUANT_VALUES_FEW_ROWS
    segments = min(triton.next_power_of_2(num_blocks), max(1, values // block))
    tile_rows = min(triton.next_power_of_2(rows), max(1, values // (segments * block)))
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(num_blocks, segments))
    # a round trip writes no scales: its s_ptr is never stored to
    _act_quant_kernel[grid](x, q, q if scales is None else scales, rows, cols, x.stride(0), q.stride(0), num_blocks,
                            x if up is None else up, x.stride(0) if up is None else up.stride(0), float(limit),
                            BLOCK=block, ROWS=tile_rows, SEGMENTS=segments, NATIVE_FP8=_native_fp8(x.device),
                            ROUND_TRIP=scales is None, PAIRS_APART=pairs_apart, SWIGLU=up is not None, **LAUNCH)


def act_quant(x: torch.Tensor, block: int, pairs_apart: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (e4m3 [M, K], fp32 power-of-two scales [M, ceil(K / block)]). ``pairs_apart``: the values
    as fp16 (exact), each 32 columns' even ones first, then the odd ones (the MXFP4 experts' MMAs read them so)."""
    rows, cols = x.shape
    if pairs_apart and cols % 32:
        raise ValueError(f"{cols} columns are not whole 32-column blocks")
    q = torch.empty(rows, cols, dtype=torch.float16 if pairs_apart else torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, triton.cdiv(cols, block), dtype=torch.float32, device=x.device)
    _act_quant(x, block, q, scales, pairs_apart)
    return q, scales


def fp8_rounded(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` [M, K] rounded to FP8 in ``1 x block`` segments, as bf16 (exact: e4m3 values times powers of two), in
    one pass: what a bf16 GEMM reads where the reference rounds its input to FP8."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _act_quant(x, block, out, None)
    return out


def swiglu_fp8_rounded(gate: torch.Tensor, up: torch.Tensor, limit: float, block: int) -> torch.Tensor:
    """``fp8_rounded(swiglu(gate, up, limit))`` with SwiGLU's fp32 result rounded straight to FP8, in one pass: a
    down projection's input where the reference rounds it (gate and up [M, K], rows of unit column stride)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"swiglu_fp8_rounded: gate {tuple(gate.shape)} and up {tuple(up.shape)} must be equal "
                         "[rows, columns] with unit column strides")
    out = torch.empty(gate.shape, dtype=torch.bfloat16, device=gate.device)
    _act_quant(gate, block, out, None, up=up, limit=limit)
    return out
