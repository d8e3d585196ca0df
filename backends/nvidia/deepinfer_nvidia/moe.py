"""Routed experts in Triton, one grouped GEMM launch per projection for all experts: packed MXFP4 weights (what the
releases ship), FP8 ones (V4-Flash-Base; ``moe_fp8``) or float ones (bf16, fp16, fp32: tiny and converted models).

Assignments (token, expert) are sorted by expert and cut into blocks of ``bm`` rows (16 at decode, 64 in long
prefills) that each belong to one expert (``moe_blocks`` builds that table in one launch at decode). How many blocks
there are depends on the routing, which only the GPU knows; waiting for it would stall the host and forbid CUDA
graphs. So the grid has a bound computed from shapes alone (each expert's last block may be partial:
``ceil(T*k / bm) + min(E, T*k)``) and the surplus blocks get 0 rows and return before reading any weight. Nothing in
``routed_experts`` synchronises with the host or has a data-dependent shape: it can be captured in a CUDA graph and
replayed with other routing.

w1 and w3 share one launch: each block reads its activation tile once for both weights and writes
``swiglu(gate, up)`` (``deepinfer.runtime.ops``). w2 reads those rows in expert order and writes each result to its
(token, slot) row, so the top-k sum is a plain reduction rather than a scatter.

MXFP4: layers whose shapes and scales allow it are repacked on first use and served by ``moe_mxfp4``'s swap-AB
kernel (1.5x this file's at decode on an H200, BENCHMARKS.md); this file's byte-layout kernel serves the others (K
not a multiple of 64, N not of 16, a scale above 2) and batch-invariant mode, whose tiles it pins. There, since
Hopper has no FP4 tensor cores, each byte of two e2m1 codes is decoded by moving bits into two fp16
values (the codes times 2^-14), the low nibbles being the even columns and the high ones the odd; on the GPU
``_e2m1_pairs`` does it for two values per 32-bit operation in inline PTX (seven integer ops per four values;
Triton's interpreter runs ``_e2m1_scaled``'s int16 ops per value instead). The FP8-rounded activations come from
``act_quant(..., pairs_apart=True)`` as fp16 (exact), each 32 columns' even ones first, so the kernel loads the two halves
each MMA reads as they are; each 32-column block is two fp16 MMAs with fp32 accumulation, scaled once by its
weight scale (one power of two per 32 columns and row, read four to an int32 word and made fp32 by moving bits),
the activation's and 2^14. Every product is exact, so the result is the reference's up to fp32 summation order.
Integer work per weight value is what bounds this kernel (about six instructions per value in the compiled loop,
against half a byte read), and a decode step has few (expert, column tile) programs, so its tile sizes, warps and
pipeline depth are autotuned per (N, K, rows per block), in the eager run that precedes a graph capture.

Float weights: the reference (``project``) multiplies in fp32. Here activations are rounded to the weight's dtype
for its tensor cores, with fp32 accumulation; for bf16/fp16 weights that rounds SwiGLU's fp32 output (and ``x`` if
its dtype differs), fp32 weights get a full-precision dot rather than TF32.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia import (INTERPRETED, activation, moe_blocks, moe_fp8, moe_grouped, moe_mxfp4, moe_mxfp4_layout,
                              routing)
from deepinfer_nvidia.moe_blocks import e8m0_to_fp32
from deepinfer_nvidia.fp8_rounding import act_quant, fp8_rounded

logger = init_logger(__name__)

# Rows per block: the few tokens each expert gets at decode fill one 16-row MMA tile; in a long prefill each expert
# gets hundreds, and 64-row blocks read each expert's weights a quarter as often.
SMALL_BM, LARGE_BM = 16, 64


def block_rows(assignments: int, experts: int) -> int:
    return LARGE_BM if assignments >= 32 * experts else SMALL_BM
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _e2m1_scaled(nibble_bits, SIGN_SHIFT: tl.constexpr, MAGNITUDE_SHIFT: tl.constexpr):
    """fp16 of e2m1 codes times 2^-14, from the int16 bytes holding them: the sign bit moves to fp16's sign and the
    three magnitude bits to the top of fp16's exponent-low/mantissa-high bits. Codes 2..7 land on normal numbers
    (2^(e-15) (1 + m/2)), code 1 (0.5) on the subnormal 2^-15, code 0 on zero: no selects, no float math, five
    integer ops per value."""
    sign = (nibble_bits & (8 << SIGN_SHIFT)) << (12 - SIGN_SHIFT)
    bits = sign | ((nibble_bits & (7 << SIGN_SHIFT)) << MAGNITUDE_SHIFT)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


# PTX for four packed bytes -> their four low-nibble (even-column) and four high-nibble (odd-column) codes as fp16x2
# words, times 2^-14 as _e2m1_scaled places them: a byte permute puts two bytes in the high bytes of a word's
# halves, where a high nibble's sign bit already is fp16's; each code's magnitude bits (and a low nibble's sign)
# then move into place for two values at a time: seven integer ops per four values, which Triton's interpreter
# cannot run (it runs _e2m1_scaled's int16 ops instead).
_E2M1_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 z, t0, t1, m, s;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x1404;
prmt.b32 t1, $4, z, 0x3424;
shl.b32 m, t0, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, t0, 4; and.b32 s, s, 0x80008000; or.b32 $0, m, s;
shl.b32 m, t1, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, t1, 4; and.b32 s, s, 0x80008000; or.b32 $1, m, s;
shr.b32 m, t0, 3; and.b32 m, m, 0x0E000E00; and.b32 s, t0, 0x80008000; or.b32 $2, m, s;
shr.b32 m, t1, 3; and.b32 m, m, 0x0E000E00; and.b32 s, t1, 0x80008000; or.b32 $3, m, s;
}
""")


@triton.jit
def _e2m1_pairs(packed):
    """(even, odd) fp16 codes times 2^-14 of int8 bytes [BN, 16], as ``_e2m1_scaled`` gives them."""
    return tl.inline_asm_elementwise(_E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def _e8m0(ptrs, ok):
    """fp32 powers of two from e8m0 exponent bytes."""
    return e8m0_to_fp32(tl.load(ptrs, mask=ok, other=127).to(tl.int32) & 0xFF)


@triton.jit
def _e8m0_of_word(words, BYTE: tl.constexpr):
    """fp32 powers of two from byte BYTE of int32 words holding four e8m0 exponents (one load for four scales)."""
    return e8m0_to_fp32((words >> (8 * BYTE)) & 0xFF)


@triton.jit
def _e2m1_halves(w_ptrs, n_ok, PACKED: tl.constexpr):
    """(even, odd) fp16 codes times 2^-14 of 32 packed columns of BN weight rows [BN, 16]."""
    if PACKED:
        even, odd = _e2m1_pairs(tl.load(w_ptrs, mask=n_ok[:, None], other=0))
    else:  # Triton's interpreter runs no PTX
        packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0).to(tl.int16)  # [BN, 16]
        even = _e2m1_scaled(packed, 0, 9)
        odd = _e2m1_scaled(packed, 4, 5)
    return even, odd


@triton.jit
def _fp4_block(acc, a_even, a_odd, sa, w_ptrs, sw, n_ok, NATIVE: tl.constexpr, PACKED: tl.constexpr):
    """``acc`` plus one 32-column block: activations [R, 16] (e4m3 values in fp16), even columns and odd ones,
    times 32 packed columns of BN weight rows, scaled by the activation's ``sa`` [R] and the weights' ``sw`` [BN]
    powers of two (with the 2^14 the decode leaves out). The low nibbles are the even columns, the high ones the odd:
    two K=16 MMAs instead of interleaving the decoded values."""
    even, odd = _e2m1_halves(w_ptrs, n_ok, PACKED and NATIVE)
    if not NATIVE:  # the interpreter: the same values in fp32
        a_even, a_odd, even, odd = a_even.to(tl.float32), a_odd.to(tl.float32), even.to(tl.float32), odd.to(tl.float32)
    part = tl.dot(a_odd, tl.trans(odd), tl.dot(a_even, tl.trans(even)))
    return acc + part * (sa * 16384.0)[:, None] * sw[None, :]


@triton.jit
def _float_chunk(acc, a, w_ptrs, mask, NATIVE: tl.constexpr):
    """``acc`` plus ``a`` [BM, BK] times one BK-deep tile of weight rows."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if not NATIVE:  # the interpreter has no bf16 arithmetic (and rounds to it wrongly): unrounded fp32 products
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    elif w.dtype == tl.float32:  # what fp32 weights are for: the reference's precision, not TF32's
        acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
    return acc


@triton.jit
def _fp4_rows(a_ptr, sa_ptr, rows, m_ok, w_ptr, v_ptr, sw_ptr, sv_ptr, w_tile, s_tile, n_ok, stride_a, stride_sa,
              K: tl.constexpr, ACT_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              SWIGLU: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr, WORD_SCALES: tl.constexpr):
    """(a W^T, a V^T) [BLOCK_M, BN] in fp32 for the rows ``rows`` of ``a`` (masked by ``m_ok``): fp16 e4m3 values,
    each 32 columns' even ones first (``act_quant``'s ``pairs_apart``). With WORD_SCALES the scale pointers address int32
    words of four e8m0 exponents (128 columns), else bytes."""
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for tile in range(K // BK):
        for block in tl.static_range(BK // 32):  # each 32 columns: one weight scale per row, the sum scaled once
            k0 = tile * BK + block * 32
            if WORD_SCALES and block % 4 == 0:
                w_words = tl.load(sw_ptr + s_tile + k0 // 128, mask=n_ok, other=0x7F7F7F7F)
                if SWIGLU:
                    v_words = tl.load(sv_ptr + s_tile + k0 // 128, mask=n_ok, other=0x7F7F7F7F)
            a_ptrs = a_ptr + rows[:, None] * stride_a + k0 + tl.arange(0, 16)[None, :]  # each 32: even, then odd
            a_even = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            a_odd = tl.load(a_ptrs + 16, mask=m_ok[:, None], other=0.0)
            sa = tl.load(sa_ptr + rows * stride_sa + k0 // ACT_BLOCK, mask=m_ok, other=0.0)
            if WORD_SCALES:
                sw = _e8m0_of_word(w_words, block % 4)
            else:
                sw = _e8m0(sw_ptr + s_tile + k0 // 32, n_ok)
            acc = _fp4_block(acc, a_even, a_odd, sa, w_ptr + w_tile + k0 // 2, sw, n_ok, NATIVE, PACKED)
            if SWIGLU:
                if WORD_SCALES:
                    sv = _e8m0_of_word(v_words, block % 4)
                else:
                    sv = _e8m0(sv_ptr + s_tile + k0 // 32, n_ok)
                up = _fp4_block(up, a_even, a_odd, sa, v_ptr + w_tile + k0 // 2, sv, n_ok, NATIVE, PACKED)
    return acc, up


@triton.jit
def _fp4_experts_kernel(a_ptr, sa_ptr, a_rows_ptr, w_ptr, v_ptr, sw_ptr, sv_ptr, out_ptr, out_rows_ptr,
                        block_expert_ptr, block_start_ptr, block_rows_ptr, N, limit, stride_a, stride_sa, stride_we,
                        stride_wn, stride_swe, stride_swn, stride_out, K: tl.constexpr, ACT_BLOCK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr,
                        NATIVE: tl.constexpr, PACKED: tl.constexpr, WORD_SCALES: tl.constexpr):
    """out = a W^T for one block of rows and BN columns; with SWIGLU, swiglu(a W^T, a V^T)."""
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    w_tile = expert * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    s_tile = expert * stride_swe + offs_n * stride_swn
    acc, up = _fp4_rows(a_ptr, sa_ptr, rows, m_ok, w_ptr, v_ptr, sw_ptr, sv_ptr, w_tile, s_tile, n_ok, stride_a,
                        stride_sa, K, ACT_BLOCK, BLOCK_M, BN, BK, SWIGLU, NATIVE, PACKED, WORD_SCALES)
    moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                           SWIGLU)


@triton.jit
def _float_experts_kernel(a_ptr, a_rows_ptr, w_ptr, v_ptr, out_ptr, out_rows_ptr, block_expert_ptr, block_start_ptr,
                          block_rows_ptr, N, limit, stride_a, stride_we, stride_wn, stride_out, K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr,
                          NATIVE: tl.constexpr):
    """The same as ``_fp4_experts_kernel`` for float weights: plain BK-deep tiles, no scales."""
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    w_tile = expert * stride_we + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        acc = _float_chunk(acc, a, w_ptr + w_tile + k[None, :], w_ok, NATIVE)
        if SWIGLU:
            up = _float_chunk(up, a, v_ptr + w_tile + k[None, :], w_ok, NATIVE)
    moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                           SWIGLU)


def _blocks(topk_ids: torch.Tensor, experts: int, bm: int):
    """Expert-sorted assignment order and, per block of a grid sized from shapes alone, its expert, first sorted row
    and row count (0 for surplus blocks). Only device-side ops: no bincount or repeat_interleave, which sync."""
    device = topk_ids.device
    sorted_ids, order, first_row = moe_blocks.expert_sorted(topk_ids, experts)
    counts = first_row.diff()
    per_expert = (counts + bm - 1) // bm
    block_end = torch.cumsum(per_expert, 0)
    assignments = sorted_ids.numel()
    block = torch.arange(triton.cdiv(assignments, bm) + min(experts, assignments), device=device)
    # the expert whose blocks cover ``block``; past the last block, the last expert with an index beyond its rows
    expert = torch.searchsorted(block_end, block, right=True).clamp_(max=experts - 1)
    index_in_expert = block - (block_end - per_expert)[expert]
    start = first_row[expert] + index_in_expert * bm
    rows = (counts[expert] - index_in_expert * bm).clamp(0, bm)
    return order, (expert.int(), start.int(), rows.int())


def _grid(blocks, n):
    bn = 64 if n >= 64 else 32
    return (len(blocks[0]), triton.cdiv(n, bn)), bn


# (BN, BK, warps, stages) the MXFP4 kernel's tuner times
FP4_TILE_SHAPES = [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (32, 256, 4, 2),
                   (64, 256, 8, 2), (16, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3)]


@functools.cache
def _tuned_fp4_experts():
    """The MXFP4 kernel autotuned once per (N, K, rows per block, fused w1/w3): column tile, K tile, warps,
    stages."""
    configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in FP4_TILE_SHAPES]

    def fitting(configs, named_args, **kwargs):  # K tiles must divide K; K is a keyword (constexpr) argument
        k = kwargs["K"]  # a multiple of 32, the MXFP4 block
        step = 128 if kwargs["WORD_SCALES"] else 32  # a tile reads whole words of four scales
        return ([c for c in configs if k % c.kwargs["BK"] == 0 and c.kwargs["BK"] % step == 0]
                or [triton.Config({"BN": 32, "BK": step}, num_warps=4)])

    return triton.autotune(configs=configs, key=["N", "K", "BLOCK_M", "SWIGLU", "PACKED", "WORD_SCALES"],
                           prune_configs_by={"early_config_prune": fitting})(_fp4_experts_kernel)


# Batch-invariant mode's MXFP4 configuration: a row's 32-column blocks are summed in order whatever the tiles, but
# the tile shape picks the MMA instructions, whose own summation order is unspecified, so the autotuner's choice
# (per rows per block) must not apply.
PINNED_FP4_TILES = {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3}


# Switches for tools/gpu/gpu_mxfp4.py: e2m1 codes decoded by _e2m1_pairs' packed PTX (True) or _e2m1_scaled's int16
# ops; scales read four to a word where the rows allow it (True) or a byte at a time
PACKED_E2M1_DECODE = True
WORD_SCALES = True


def _scale_words(scales: torch.Tensor, k: int) -> torch.Tensor | None:
    """The e8m0 scales [E, N, K/32] as int32 words of four, when their rows allow it."""
    if not WORD_SCALES or k % 128 or scales.stride(-1) != 1 or scales.stride(0) % 4 or scales.stride(1) % 4:
        return None
    if scales.storage_offset() % 4 or scales.untyped_storage().data_ptr() % 4:
        return None
    return scales.view(torch.int32)


def _fp4_experts(a, a_rows, out_rows, w, w_scale, blocks, bm, activation_block, v=None, v_scale=None, limit=0.0,
                 pinned=False):
    """fp32 [len(out_rows), N]: rows of ``a`` (FP8-rounded here) times w, or swiglu of w and v when v is given."""
    aq, sa = act_quant(a.contiguous(), activation_block, pairs_apart=True)
    n, k = w.shape[1], 2 * w.shape[2]
    out = torch.empty(len(out_rows), n, dtype=torch.float32, device=a.device)
    swiglu = v is not None
    # read as exponents in the kernel: no fp32 copy of every expert's scales
    scales, v_scale = w_scale.view(torch.uint8), (v_scale if swiglu else w_scale).view(torch.uint8)
    words = _scale_words(scales, k), _scale_words(v_scale, k)
    word_scales = words[0] is not None and words[1] is not None
    if word_scales:
        scales, v_scale = words
    v = v if swiglu else w

    def grid(meta):
        return len(blocks[0]), triton.cdiv(n, meta["BN"])

    # the interpreter cannot time configurations: it runs one
    if INTERPRETED or a.device.type != "cuda":
        kernel, tiles = _fp4_experts_kernel, {"BN": _grid(blocks, n)[1], "BK": 128 if k % 128 == 0 else 32}
    elif pinned:
        kernel, tiles = _fp4_experts_kernel, PINNED_FP4_TILES | {"BK": max(bk for bk in (128, 64, 32) if k % bk == 0)}
    else:
        kernel, tiles = _tuned_fp4_experts(), {}
    kernel[grid](aq, sa, a_rows, w, v, scales, v_scale, out, out_rows, *blocks, n, limit, aq.stride(0), sa.stride(0),
                 w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), out.stride(0), K=k,
                 ACT_BLOCK=activation_block, BLOCK_M=bm, SWIGLU=swiglu, NATIVE=a.device.type == "cuda",
                 PACKED=PACKED_E2M1_DECODE, WORD_SCALES=word_scales, **tiles)
    return out


def _float_experts(a, a_rows, out_rows, w, blocks, bm, v=None, limit=0.0):
    """As ``_fp4_experts`` for float weights, with the activations as they are."""
    a = a.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(len(out_rows), n, dtype=torch.float32, device=a.device)
    grid, bn = _grid(blocks, n)
    _float_experts_kernel[grid](a, a_rows, w, w if v is None else v, out, out_rows, *blocks, n, limit, a.stride(0),
                                w.stride(0), w.stride(1), out.stride(0), K=k, BLOCK_M=bm, BN=bn, BK=64,
                                SWIGLU=v is not None, NATIVE=a.device.type == "cuda")
    return out


class TritonMoE:
    name = "triton"
    graph_safe = True

    def __init__(self, reference, pinned: bool = False, grouped_gemm=None, grouped_align: int = 0,
                 masked_gemm=None, masked_align: int = 0, repack_fp4: bool = True):
        self.reference = reference  # serves what no kernel here takes (weights of other formats), with a warning
        self.pinned = pinned  # 16-row blocks and one tile configuration whatever the batch (batch-invariant mode)
        self.batch_invariant = pinned
        # MXFP4 experts repacked in place for moe_mxfp4 (False: the byte layout's kernel); batch-invariant mode keeps
        # the byte layout's pinned tiles
        self.repack_fp4 = repack_fp4
        # DeepGEMM's m_grouped_bf16_gemm_nt_contiguous and its M alignment: long prefills (moe_grouped); its
        # m_grouped_fp8_gemm_nt_masked and its M alignment: FP8 experts at decode (moe_fp8)
        self.grouped_gemm, self.grouped_align = (None, 0) if pinned else (grouped_gemm, grouped_align)
        self.masked_gemm, self.masked_align = (None, 0) if pinned else (masked_gemm, masked_align)
        if pinned:
            self.name = "triton, pinned tiles (batch-invariant)"
        elif grouped_gemm is not None:
            self.name = "triton; DeepGEMM's grouped GEMM in long prefills" + (
                " and its masked FP8 GEMM for FP8 experts at decode" if masked_gemm is not None else "")

    def route(self, x, token_ids, router):
        return routing.route(x, token_ids, router, pinned=self.pinned)

    def swiglu(self, gate, up, limit):
        return activation.swiglu(gate, up, limit)

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        w1, w3, w2 = weights.w1, weights.w3, weights.w2
        fp4 = w1.dtype == torch.int8
        fp8 = w1.dtype == torch.float8_e4m3fn and weights.w1_scale is not None
        if fp8:
            served = moe_fp8.triton_serves(weights, x.device)
        else:
            served = fp4 or (weights.w1_scale is None and w1.dtype in FLOAT_DTYPES)
        if not served:
            narrow = " in tiles under 32 columns" if fp8 else ""
            log_once(logger, logging.WARNING, f"{w1.dtype} routed experts{narrow}: no Triton kernel, the torch "
                                              "reference runs them (slower, and it syncs with the host: no CUDA graphs)")
            return self.reference.routed_experts(x, topk_ids, topk_weights, weights)
        # the kernels address w1's and w3's tiles with one set of strides, unit along a row
        pairs = [(w1, w3)] + ([(weights.w1_scale, weights.w3_scale)] if fp4 or fp8 else [])
        if any(a.stride() != b.stride() for a, b in pairs) or w1.stride(-1) != 1 or w2.stride(-1) != 1:
            raise ValueError("routed experts: w1 and w3 (and their scales) need equal strides, and rows unit ones")
        tokens, top_k = topk_ids.shape
        if tokens == 0:
            return torch.zeros_like(x)
        if fp8 and self.masked_gemm is not None and moe_fp8.masked_serves(tokens, weights):
            return moe_fp8.masked_routed_experts(self.masked_gemm, self.masked_align, x, topk_ids, topk_weights,
                                                 weights)
        if self.grouped_gemm is not None and moe_grouped.serves(topk_ids.numel(), weights):
            return moe_grouped.routed_experts(self.grouped_gemm, self.grouped_align, x, topk_ids, topk_weights, weights)
        bm = SMALL_BM if self.pinned else block_rows(topk_ids.numel(), w1.shape[0])
        if moe_blocks.serves(topk_ids.numel()):  # decode: one launch instead of ~20 small ones
            order, token_of, sorted_rows, blocks = moe_blocks.expert_blocks(topk_ids, w1.shape[0], bm)
        else:
            order, blocks = _blocks(topk_ids, w1.shape[0], bm)
            token_of, order = (order // top_k).int(), order.int()
            sorted_rows = torch.arange(len(order), dtype=torch.int32, device=x.device)
        limit = weights.swiglu_limit
        if fp8:
            block, chunk = weights.activation_block, moe_fp8.chunk_columns(weights)
            h = moe_fp8.fp8_experts(x, token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, block, chunk, w3,
                                    weights.w3_scale, limit)
            down = moe_fp8.fp8_experts(h, sorted_rows, order, w2, weights.w2_scale, blocks, bm, block, chunk)
        elif fp4 and not self.pinned and self.repack_fp4 and moe_mxfp4_layout.prepare(weights) is None:
            block = weights.activation_block
            h = moe_mxfp4.experts(fp8_rounded(x, block), token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, w3,
                                  weights.w3_scale, limit)
            down = moe_mxfp4.experts(fp8_rounded(h, block), sorted_rows, order, w2, weights.w2_scale, blocks, bm)
        elif fp4:
            block = weights.activation_block
            h = _fp4_experts(x, token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, block, w3, weights.w3_scale,
                             limit, self.pinned)
            down = _fp4_experts(h, sorted_rows, order, w2, weights.w2_scale, blocks, bm, block, pinned=self.pinned)
        else:
            h = _float_experts(x, token_of, sorted_rows, w1, blocks, bm, w3, limit)
            down = _float_experts(h, sorted_rows, order, w2, blocks, bm)
        return moe_blocks.combine(down, topk_weights, x.dtype)
