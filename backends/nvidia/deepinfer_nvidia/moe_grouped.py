"""A long prefill's routed experts through DeepGEMM's m-grouped contiguous bf16 GEMM (``moe.TritonMoE`` picks it).

With hundreds of rows per expert the experts are bound by tensor-core throughput, where DeepGEMM's wgmma/TMA
kernel runs faster than our Triton grouped kernel. Its contiguous layout stacks each expert's rows, padded to
DeepGEMM's M alignment, with each row's expert in ``grouped_layout`` and -1 on padding rows. DeepGEMM skips the
MMAs of an M block whose first row is -1 but still stores the block (zeros), and computes the padding rows of the
other blocks (nothing reads them). So every call gets exactly the rows of its experts, which takes the padded
segment bounds on the host: one synchronisation per call, which a long prefill (never in a CUDA graph, hundreds of
microseconds of device work per launch) does not notice.

MXFP4 experts: Hopper has no FP4 tensor cores, so each chunk of ``FP4_CHUNK_EXPERTS`` experts that has rows is
dequantized into a bf16 scratch and run through the same GEMM on its own rows, w1/w3 for every chunk, then SwiGLU
once, then w2 (each weight is dequantized once). Both operands are exact in bf16: an e2m1 code times a power of
two, and an e4m3 activation (the reference's FP8 rounding) times its power-of-two scale. So the products are the
reference's, up to fp32 summation order. DeepGEMM writes bf16 only, though: gate and up are rounded to bf16 before
SwiGLU, as in DeepSeek's own inference code, where the reference keeps fp32. That moves ~5% of the FP8 roundings of
SwiGLU's output by one e4m3 step, ~2% of the routed output's norm (the Triton kernel's fp32 path stays within 1e-8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import activation, moe_blocks, moe_mxfp4, moe_mxfp4_layout
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import fp8_rounded, swiglu_fp8_rounded

# Rows per expert, on average over the layer's experts, from which the grouped GEMM serves a call: below, padding
# each expert to the M alignment (and for MXFP4 dequantizing every expert) costs more than the Triton kernel loses.
# H200 (docs/benchmarks-history.md, the grouped GEMM's threshold run): bf16 1.09x at 48 rows, 0.85x at 12; MXFP4 1.08x at 64, 0.72x at 32.
MIN_ROWS_PER_EXPERT = {"bf16": 48, "mxfp4": 64}
# Widths in whole 64-column tiles (DeepGEMM's bf16 K tile; every V4 and V4.1 width is one), and at least this wide:
# measured at V4-Flash's and V4.1-Flash's widths only; small experts (test and embedded models, whose decode
# batches can reach the row threshold) keep the Triton path, which never synchronises with the host.
SHAPE_MULTIPLE, MIN_WIDTH = 64, 1024
# MXFP4 experts dequantized at a time, one weight at a time: 32 of V4.1-Flash's w1 are a 755 MB bf16 scratch.
FP4_CHUNK_EXPERTS = 32


def serves(assignments: int, weights) -> bool:
    """A call the grouped GEMM takes: enough rows per expert, bf16 or MXFP4 weights, DeepGEMM-sized widths, and
    no CUDA graph being captured (its host synchronisation cannot be)."""
    w1, w2 = weights.w1, weights.w2
    fp4 = w1.dtype == torch.int8
    if not fp4 and (w1.dtype != torch.bfloat16 or weights.w1_scale is not None):
        return False
    hidden, inter = w2.shape[1], w2.shape[2] * (2 if fp4 else 1)
    if assignments < MIN_ROWS_PER_EXPERT["mxfp4" if fp4 else "bf16"] * w1.shape[0]:
        return False
    if any(width % SHAPE_MULTIPLE or width < MIN_WIDTH for width in (hidden, inter)):
        return False
    return not (w1.is_cuda and torch.cuda.is_current_stream_capturing())


def contiguous_layout(topk_ids: torch.Tensor, experts: int, align: int, chunk: int):
    """``(padded_row, layout, bounds)``: each assignment's row (in ``topk_ids.flatten()`` order) in the expert-sorted,
    per-expert padded layout; each padded row's expert counted from its chunk of ``chunk`` experts (int32, -1 on
    padding); and the first padded row of each expert and the total, on the host (the one synchronisation)."""
    flat = topk_ids.flatten()
    sorted_ids, order, first_row = moe_blocks.expert_sorted(topk_ids, experts)
    padded = (first_row.diff() + align - 1) // align * align
    padded_bounds = torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])
    padded_row = moe_blocks.rows_from(sorted_ids, order, first_row, padded_bounds)
    bounds = padded_bounds.tolist()
    layout = torch.full((bounds[-1],), -1, dtype=torch.int32, device=flat.device)
    layout[padded_row] = (flat % chunk).int()
    return padded_row, layout, bounds


@triton.jit
def _fp4_times_scale(codes, scale):
    """bf16 bits (int32) of e2m1 ``codes`` (0-15) times ``scale`` (fp32), the operands built from bits (no exp2):
    magnitude m >= 1 is 2^((m >> 1) - 1), times 1.5 when m >= 2 is odd; the product is exact in bf16 unless the
    scale leaves its range, where the fp32 -> bf16 rounding gives what the reference's multiply would."""
    magnitude = codes & 7
    bits = ((126 + (magnitude >> 1)) << 23) | (((magnitude >= 2) & ((magnitude & 1) == 1)).to(tl.int32) << 22)
    bits = tl.where(magnitude == 0, 0, bits) | ((codes & 8) << 28)
    value = bits.to(tl.float32, bitcast=True) * scale
    return value.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _dequant_fp4_kernel(codes_ptr, scales_ptr, out_ptr, rows, rows_per_expert, stride_ce, stride_cn, stride_se,
                        stride_sn, HALF_K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS weight rows' BLOCK packed bytes -> as many 32-bit words of two bf16 values (the low nibble, the even
    column, in the low half: the little-endian order of the bf16 row), each code times its 32-column block's e8m0
    scale."""
    wait_for_inputs()
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    expert, n = (row // rows_per_expert).to(tl.int64), (row % rows_per_expert).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (row < rows)[:, None] & (offs < HALF_K)[None, :]
    packed = tl.load(codes_ptr + (expert * stride_ce + n * stride_cn)[:, None] + offs[None, :], mask=ok, other=0)
    packed = packed.to(tl.int32) & 0xFF
    exponent = tl.load(scales_ptr + (expert * stride_se + n * stride_sn)[:, None] + (offs // 16)[None, :], mask=ok,
                       other=127).to(tl.int32) & 0xFF
    scale = moe_blocks.e8m0_to_fp32(exponent)
    words = _fp4_times_scale(packed & 0xF, scale) | (_fp4_times_scale(packed >> 4, scale) << 16)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * HALF_K + offs[None, :], words, mask=ok)


def dequantize_fp4_experts(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed MXFP4 experts ``codes`` [E, N, K/2] (int8, unit column stride) with e8m0 ``scales`` [E, N, K/32] ->
    bf16 [E, N, K], exact (written into ``out``'s first E experts when given)."""
    experts, rows, half = codes.shape
    if out is None:
        out = torch.empty(experts, rows, 2 * half, dtype=torch.bfloat16, device=codes.device)
    exponents = scales.view(torch.uint8)
    block, tile_rows = min(256, triton.next_power_of_2(half)), 8
    if experts * rows:
        grid = (triton.cdiv(experts * rows, tile_rows), triton.cdiv(half, block))
        _dequant_fp4_kernel[grid](codes, exponents, out.view(torch.int32), experts * rows, rows, codes.stride(0),
                                  codes.stride(1), exponents.stride(0), exponents.stride(1), HALF_K=half,
                                  ROWS=tile_rows, BLOCK=block, **LAUNCH)
    return out[:experts]


def _dequantized(codes, scales, first: int, last: int, scratch):
    """Experts first..last-1 of a packed MXFP4 stack as bf16, in either byte layout."""
    if moe_mxfp4_layout.is_repacked(codes):
        return moe_mxfp4.dequantize(codes[first:last], scales[first:last], scratch)
    return dequantize_fp4_experts(codes[first:last], scales[first:last], scratch)


def routed_experts(gemm, align: int, x, topk_ids, topk_weights, weights, chunk_experts: int = FP4_CHUNK_EXPERTS):
    """``TritonMoE.routed_experts`` through ``gemm(a, b, d, layout)`` with ``m_grouped_bf16_gemm_nt_contiguous``'s
    contract: ``d[r] = a[r] b[layout[r]]^T`` for the rows whose layout is not -1."""
    w1, w3, w2 = weights.w1, weights.w3, weights.w2
    fp4 = w1.dtype == torch.int8
    experts, top_k = w1.shape[0], topk_ids.shape[1]
    chunk = chunk_experts if fp4 else experts
    padded_row, layout, bounds = contiguous_layout(topk_ids, experts, align, chunk)
    # (first expert, last + 1, first padded row, last + 1) of each chunk with rows
    spans = [(first, min(first + chunk, experts)) for first in range(0, experts, chunk)]
    chunks = [(first, last, bounds[first], bounds[last]) for first, last in spans if bounds[last] > bounds[first]]
    block = weights.activation_block
    a = fp8_rounded(x.contiguous(), block) if fp4 else x.to(torch.bfloat16)
    stacked = torch.empty(len(layout), a.shape[1], dtype=torch.bfloat16, device=x.device)
    stacked[padded_row.view(-1, top_k)] = a.unsqueeze(1)  # each token's row into its top-k slots
    inter, hidden = w2.shape[2] * (2 if fp4 else 1), w2.shape[1]
    gate, up = (torch.empty(len(layout), inter, dtype=torch.bfloat16, device=x.device) for _ in range(2))
    scratch = torch.empty(chunk, inter, hidden, dtype=torch.bfloat16, device=x.device) if fp4 else None
    for first, last, lo, hi in chunks:
        for w, scale, out in ((w1, weights.w1_scale, gate), (w3, weights.w3_scale, up)):
            b = _dequantized(w, scale, first, last, scratch) if fp4 else w
            gemm(stacked[lo:hi], b, out[lo:hi], layout[lo:hi])
    if fp4:  # SwiGLU's fp32 result rounded straight to FP8, as the reference rounds it
        h = swiglu_fp8_rounded(gate, up, weights.swiglu_limit, block)
        scratch = scratch.view(chunk, hidden, inter)  # w2's shape, the same bytes
    else:
        h = activation.swiglu(gate, up, weights.swiglu_limit)
    down = torch.empty(len(layout), hidden, dtype=torch.bfloat16, device=x.device)
    for first, last, lo, hi in chunks:
        b = _dequantized(w2, weights.w2_scale, first, last, scratch) if fp4 else w2
        gemm(h[lo:hi], b, down[lo:hi], layout[lo:hi])
    return moe_blocks.combine(down[padded_row], topk_weights, x.dtype)
