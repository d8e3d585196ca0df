"""Block-scaled FP8 GEMM in Triton: ``y = x W^T`` for an e4m3 weight [N, K] with e8m0 tile scales.

As the release's GEMMs work: ``x`` is rounded to e4m3 with one power-of-two scale per ``1 x BK`` segment
(``act_quant``), then each ``BK``-deep tile is multiplied on the tensor cores and its fp32 partial product added
times both scales. On Hopper an fp8 MMA accumulates in reduced precision, so promoting every BK = 32 or 128 values
keeps the sum exact to fp32 rounding. ``BK`` is the activation block, which equals the weight's column tile (the
loader checks the scales against ``quantization_config.weight_block_size``). Two GEMM kernels: an autotuned one
for many rows (``fp8_bf16_gemm`` is the cuBLAS alternative under measurement) and ``_fp8_gemm_few_rows_kernel``
for decode's few.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from deepinfer.runtime.ops import fp32_logits
from deepinfer.runtime.quantization import blockwise_linear, infer_block
from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia import INTERPRETED, fp8_bf16_gemm
from deepinfer_nvidia.fp8_rounding import _e4m3_values, _native_fp8, _segment_scale, act_quant
from deepinfer_nvidia.logits import bf16_logits

logger = init_logger(__name__)


def _configs() -> list[triton.Config]:
    shapes = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3),
              (128, 128, 8, 3), (128, 64, 4, 3)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in shapes]


def _prune(configs, named_args, **kwargs):
    """Row tiles no taller than the (bucketed) token count: decode steps get 16-row tiles."""
    fitting = [c for c in configs if c.kwargs["BM"] <= max(16, named_args["M_BUCKET"])]
    return fitting or configs[:1]


@triton.jit
def _fp8_gemm_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K, M_BUCKET, stride_q, stride_w, stride_sw, stride_y,
                     NUM_BLOCKS: tl.constexpr, W_ROW_TILE: tl.constexpr, BK: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
    """One [BM, BN] tile of ``y`` from ``act_quant``'s activations."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for block in range(NUM_BLOCKS):
        k = block * BK + offs_k
        k_ok = k < K
        a = tl.load(q_ptr + offs_m[:, None] * stride_q + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if NATIVE_FP8:
            part = tl.dot(a, tl.trans(b))
        else:  # the interpreter (and pre-Hopper GPUs) multiply the same values in fp32
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        sx = tl.load(sx_ptr + offs_m * NUM_BLOCKS + block, mask=m_ok, other=0.0)
        sw = tl.load(sw_ptr + (offs_n // W_ROW_TILE) * stride_sw + block, mask=n_ok, other=0.0)
        acc += part * sx[:, None] * sw[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _few_rows_block(q_ptr, sx_ptr, w_ptr, sw_ptr, block, offs_m, offs_n, m_ok, n_ok, K, stride_q, stride_w, stride_sw,
                    NUM_BLOCKS: tl.constexpr, W_ROW_TILE: tl.constexpr, BK: tl.constexpr,
                    NATIVE_FP8: tl.constexpr, QUANTIZE: tl.constexpr):
    """One K block's [BN, BM] product, both scales applied."""
    k = block * BK + tl.arange(0, BK)
    k_ok = k < K
    scale_block = tl.minimum(block, NUM_BLOCKS - 1)  # surplus blocks: a real scale times their zero products
    a = tl.load(q_ptr + offs_m[:, None] * stride_q + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if QUANTIZE:
        sx = _segment_scale(tl.max(tl.abs(a.to(tl.float32)), axis=1))
        a = _e4m3_values(a.to(tl.float32), sx[:, None], NATIVE_FP8).to(tl.float8e4nv)
    else:
        sx = tl.load(sx_ptr + offs_m * NUM_BLOCKS + scale_block, mask=m_ok, other=0.0)
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if NATIVE_FP8:
        part = tl.dot(w, tl.trans(a))
    else:
        part = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)))
    sw = tl.load(sw_ptr + (offs_n // W_ROW_TILE) * stride_sw + scale_block, mask=n_ok, other=0.0)
    return part * sw[:, None] * sx[None, :]


@triton.jit
def _fp8_gemm_few_rows_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K, stride_q,
                              stride_w, stride_sw, stride_y, NUM_BLOCKS: tl.constexpr,
                              BLOCKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, W_ROW_TILE: tl.constexpr,
                              BK: tl.constexpr, NATIVE_FP8: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                              QUANTIZE: tl.constexpr, SUM_HERE: tl.constexpr):
    """``y^T``'s [BN, BM] tile for a few rows (a decode step's): the weight's rows on the MMA's M side, which Hopper's
    wgmma wants 64 at a time, and the BM (8 to 64) rows of ``x`` on its N side, so e4m3 meets e4m3 on the FP8
    tensor cores with no conversion and the weights are read once whatever the rows.

    K is split over program axis 1, each split's fp32 partial tile stored apart. With SUM_HERE, each split then
    counts itself in on its column tile's arrival counter; the last to arrive adds the partials in split order
    (deterministic) into ``y`` and zeroes the counter for the next call, so no second launch sums them (while the
    partials are few rows: one program reads them all). With QUANTIZE, ``q_ptr`` holds the unrounded activations
    and each program rounds its own, as ``act_quant`` does (bit for bit)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for step in range(BLOCKS_PER_SPLIT):  # the last split's surplus blocks load nothing
        acc += _few_rows_block(q_ptr, sx_ptr, w_ptr, sw_ptr, split * BLOCKS_PER_SPLIT + step, offs_m, offs_n, m_ok,
                               n_ok, K, stride_q, stride_w, stride_sw, NUM_BLOCKS, W_ROW_TILE, BK, NATIVE_FP8, QUANTIZE)
    _store_split(acc, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, offs_m, n_ok, m_ok, M, N, stride_y,
                 SPLITS, SUM_HERE)


@triton.jit
def _store_split(acc, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, offs_m, n_ok, m_ok, M, N, stride_y,
                 SPLITS: tl.constexpr, SUM_HERE: tl.constexpr):
    """A split's [BN, BM] tile of ``y^T``: stored, or kept apart as a partial. With SUM_HERE, the split counts itself
    in on its column tile's arrival counter and the last to arrive adds the partials in split order into ``y``."""
    out = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = partial_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(tile + split * M * N, acc, mask=mask)
        if SUM_HERE:
            tl.debug_barrier()  # every thread's partial is written before the count says so (release, GPU scope)
            arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                total = tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg")  # from L2: other SMs wrote them
                for s in tl.static_range(1, SPLITS):
                    total += tl.load(tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(arrivals_ptr + pid_n, 0)


# A 32-bit word of four e4m3 bytes to four fp32 values: two pair conversions and four widenings (1.5 instructions a
# byte). Triton's own conversion of byte tensors picks each byte out and re-pairs them first (about 4).
_E4M3X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def _word_bytes(words, NATIVE_FP8: tl.constexpr):
    """The four e4m3 values (lowest byte first) of each int32 word, as fp32."""
    if NATIVE_FP8:
        return tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [words],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return (_byte_value(words, 0), _byte_value(words, 8), _byte_value(words, 16), _byte_value(words, 24))


@triton.jit
def _byte_value(words, shift: tl.constexpr):
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_word(words, shift: tl.constexpr):
    """The bf16 value at bit ``shift`` of each int64 word, as fp32 (its bits moved up)."""
    return (((words >> shift) & 0xFFFF).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rounded(x, sx, NATIVE_FP8: tl.constexpr):
    """``x`` rounded to e4m3 values with its segment's scale ``sx`` (still to be multiplied back)."""
    return _e4m3_values(x, sx[:, None], NATIVE_FP8).to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, y_ptr, partial_ptr, arrivals_ptr, N, K, stride_w, stride_sw,
                     NUM_BLOCKS: tl.constexpr, CHUNKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                     W_ROW_TILE: tl.constexpr, BK: tl.constexpr, NATIVE_FP8: tl.constexpr, BN: tl.constexpr,
                     KB: tl.constexpr):
    """``y``'s BN columns for one row on the CUDA cores. The weight is read as int32 words (``w_ptr``, ``stride_w``
    in words) and the bf16 activations as int64 words (``x_ptr``), four columns each: each weight row's KB bytes a
    step are one contiguous run, each weight word widened to four fp32 values that meet its four rounded
    activations times both scales: a program's BN rows lie in one ``W_ROW_TILE``-row scale tile, so each
    activation segment meets one weight scale. The activations are rounded here, as
    ``act_quant`` rounds them (bit for bit); each program reads its next chunk of weights before it multiplies
    the current one. K splits and their sum work as in ``_fp8_gemm_few_rows_kernel``."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    SEGMENTS: tl.constexpr = KB // BK
    WORDS: tl.constexpr = BK // 4
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    scale_row = sw_ptr + (pid_n * BN // W_ROW_TILE) * stride_sw  # the program's rows share their scales
    segment = tl.arange(0, SEGMENTS)
    # [SEGMENTS, WORDS] word indices (word j holds columns 4j to 4j + 3)
    word = split * CHUNKS_PER_SPLIT * (KB // 4) + segment[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    words = K // 4
    rows = w_ptr + offs_n[:, None, None] * stride_w
    acc = tl.zeros((BN, SEGMENTS, WORDS), dtype=tl.float32)
    w = tl.load(rows + word[None, :, :], mask=n_ok[:, None, None] & (word < words)[None, :, :], other=0)
    for chunk in range(CHUNKS_PER_SPLIT):
        next_word = word + KB // 4
        w_next = tl.load(rows + next_word[None, :, :],
                         mask=n_ok[:, None, None] & ((next_word < words) & (chunk + 1 < CHUNKS_PER_SPLIT))[None, :, :],
                         other=0)
        xw = tl.load(x_ptr + word, mask=word < words, other=0)  # four bf16 columns a word, like the weight's
        x0, x1, x2, x3 = _bf16_word(xw, 0), _bf16_word(xw, 16), _bf16_word(xw, 32), _bf16_word(xw, 48)
        amax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
        sx = _segment_scale(tl.max(amax, axis=1))  # [SEGMENTS]
        block = (split * CHUNKS_PER_SPLIT + chunk) * SEGMENTS + segment
        scale = (sx * tl.load(scale_row + block, mask=block < NUM_BLOCKS, other=0.0))[:, None]
        w0, w1, w2, w3 = _word_bytes(w, NATIVE_FP8)
        acc += w0 * (_e4m3_rounded(x0, sx, NATIVE_FP8) * scale)[None, :, :]
        acc += w1 * (_e4m3_rounded(x1, sx, NATIVE_FP8) * scale)[None, :, :]
        acc += w2 * (_e4m3_rounded(x2, sx, NATIVE_FP8) * scale)[None, :, :]
        acc += w3 * (_e4m3_rounded(x3, sx, NATIVE_FP8) * scale)[None, :, :]
        w, word = w_next, next_word
    total = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]  # [BN, 1]
    _store_split(total, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, tl.arange(0, 1), n_ok,
                 tl.arange(0, 1) < 1, 1, N, N, SPLITS, True)


@triton.jit
def _sum_splits_kernel(partial_ptr, y_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``y`` = the splits' partial sums added in split order (the order ``SUM_HERE`` adds them in)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(partial_ptr + split * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# Batch-invariant mode's one configuration: tiles of different heights sum a row's K blocks differently (measured:
# 16- and 32-row tiles agree, 64-row ones do not), so the autotuner's choice per token count must not apply.
PINNED_TILES = {"BM": 16, "BN": 64, "num_warps": 4, "num_stages": 4}


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, activation_block: int,
               pinned: bool = False) -> torch.Tensor:
    """``x`` [..., K] times an e4m3 ``weight`` [N, K] with e8m0 ``scale`` tiles whose column edge is
    ``activation_block``; returns [..., N] in ``x``'s dtype. ``pinned`` uses ``PINNED_TILES`` whatever the
    token count (batch-invariant mode)."""
    n, k = weight.shape
    column_tile = infer_block(k, scale.shape[1])
    if column_tile != activation_block:
        raise ValueError(f"weight tiles of {column_tile} columns do not match the activation block {activation_block}")
    flat = x.reshape(-1, k).contiguous()
    y = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    m, num_blocks = flat.shape[0], triton.cdiv(k, activation_block)
    if not m:
        return y.view(*x.shape[:-1], n)
    weight_row_tile, scales = infer_block(n, scale.shape[0]), _fp32_scales(scale)
    if m <= FEW_ROWS and not pinned:
        _few_rows_gemm(flat, weight, scales, weight_row_tile, activation_block, y)
        return y.view(*x.shape[:-1], n)
    if not pinned and fp8_bf16_gemm.serves(flat, BF16_GEMM_MIN_ROWS):
        fp8_bf16_gemm.bf16_gemm_linear(flat, weight, scales, weight_row_tile, activation_block, y)
        return y.view(*x.shape[:-1], n)
    q, sx = act_quant(flat, activation_block)
    # the interpreter cannot time configurations: it runs the smallest tile
    if pinned or INTERPRETED:
        kernel, tiles = _fp8_gemm_kernel, PINNED_TILES if not INTERPRETED else {"BM": 16, "BN": 32}
    else:
        kernel, tiles = _tuned_gemm(), {}

    def grid(meta):
        return triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"])

    kernel[grid](q, sx, weight, scales, y, m, n, k, min(triton.next_power_of_2(m), 128), q.stride(0),
                 weight.stride(0), scale.shape[1], n, NUM_BLOCKS=num_blocks, W_ROW_TILE=weight_row_tile,
                 BK=activation_block, NATIVE_FP8=_native_fp8(x.device), **tiles)
    return y.view(*x.shape[:-1], n)


# Decode-sized calls (a few rows) go to _fp8_gemm_few_rows_kernel. Their few column tiles would each loop over all
# of K (a 1536 x 5120 projection is 12 tiles of 128 rows on a 132-SM GPU), so K is split until every SM has work.
FEW_ROWS = 64
# From this many rows a call would be cuBLAS's bf16 GEMM on the expanded weight (fp8_bf16_gemm; never in
# batch-invariant mode). Off until timed on the H200 against the Triton GEMM (tools/gpu/gpu_fp8_linear.py
# --rows 192 2048, strategy "cuBLAS on the expanded weight"): cuBLAS alone ran 3-4x faster there, the expansion's
# cost is not measured yet.
BF16_GEMM_MIN_ROWS = 1 << 62
FEW_ROWS_TILES = {"BN": 64, "num_warps": 4, "num_stages": 4}
FEW_ROWS_PROGRAMS_PER_SM = 4
MIN_BLOCKS_PER_SPLIT = 4
# Up to this many rows (padded to 8 or 16) a call is one launch: the GEMM rounds its activations and its last split
# sums the partials. Beyond, each program's share of the rounding and the last split's serial sum cost more than
# act_quant's and _sum_splits_kernel's launches (measured on the H200 at 64 rows: 1.2-1.5x slower one-launch).
ONE_LAUNCH_MAX_ROWS = 16


# One-row calls (a batch-1 decode step's) go to _fp8_gemv_kernel (CUDA cores, whole KB-byte runs of each weight
# row) for bf16 activations and K in whole 4-byte words; BN rows lie in one weight scale tile (V4.1's are 32
# rows), KB columns hold whole activation segments.
GEMV = True
GEMV_TILES = {"BN": 32, "KB": 256, "num_warps": 2, "num_stages": 1}
# Programs a call wants per SM before K is split (measured on the H200 at V4.1-Flash's projections, one row: 3 gave
# 82.4 us a layer, 5 90.3, 10 91.5; the tensor-core kernel 95.6)
GEMV_PROGRAMS_PER_SM = 3


def _gemv_tiles() -> dict:
    return GEMV_TILES if not INTERPRETED else {"BN": 16, "KB": 64}


def _gemv_serves(flat: torch.Tensor, weight: torch.Tensor, weight_row_tile: int, block: int) -> bool:
    tiles = _gemv_tiles()
    return (GEMV and flat.shape[0] == 1 and flat.dtype == torch.bfloat16 and flat.data_ptr() % 8 == 0
            and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight_row_tile % tiles["BN"] == 0
            and tiles["KB"] % block == 0 and block % 4 == 0)


def _gemv(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, weight_row_tile: int, block: int,
          y: torch.Tensor) -> None:
    k, n = flat.shape[1], weight.shape[0]
    meta = _gemv_tiles()
    tiles, chunks = triton.cdiv(n, meta["BN"]), triton.cdiv(k, meta["KB"])
    splits = max(1, min(chunks, triton.cdiv(_sm_count(flat.device) * GEMV_PROGRAMS_PER_SM, tiles)))
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    partials = torch.empty(splits, 1, n, dtype=torch.float32, device=flat.device) if splits > 1 else y
    _fp8_gemv_kernel[(tiles, splits)](
        flat.view(torch.int64), weight.view(torch.int32), scales, y, partials, _arrival_counters(flat.device, tiles), n, k,
        weight.stride(0) // 4,
        scales.stride(0), NUM_BLOCKS=triton.cdiv(k, block), CHUNKS_PER_SPLIT=per_split, SPLITS=splits,
        W_ROW_TILE=weight_row_tile, BK=block, NATIVE_FP8=_native_fp8(flat.device), **meta)


def _few_rows_gemm(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, weight_row_tile: int,
                   block: int, y: torch.Tensor) -> None:
    (m, k), n = flat.shape, weight.shape[0]
    if _gemv_serves(flat, weight, weight_row_tile, block):
        return _gemv(flat, weight, scales, weight_row_tile, block, y)
    num_blocks = triton.cdiv(k, block)
    tile_n = _few_rows_tile_n()
    splits = split_count(n, num_blocks, _programs_wanted(flat.device))
    per_split = triton.cdiv(num_blocks, splits)
    rows = max(8, triton.next_power_of_2(m))
    one_launch = rows <= ONE_LAUNCH_MAX_ROWS
    q, sx = (flat, flat) if one_launch else act_quant(flat, block)
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=flat.device) if splits > 1 else y
    tiles = triton.cdiv(n, tile_n)
    _fp8_gemm_few_rows_kernel[(tiles, splits)](
        q, sx, weight, scales, y, partials, _arrival_counters(flat.device, tiles), m, n, k, q.stride(0),
        weight.stride(0), scales.stride(0), y.stride(0), NUM_BLOCKS=num_blocks, BLOCKS_PER_SPLIT=per_split,
        SPLITS=splits, W_ROW_TILE=weight_row_tile, BK=block, NATIVE_FP8=_native_fp8(flat.device), BM=rows,
        QUANTIZE=one_launch, SUM_HERE=one_launch, **({"BN": tile_n} if INTERPRETED else FEW_ROWS_TILES))
    if splits > 1 and not one_launch:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](partials, y, m * n, SPLITS=splits, BLOCK=1024)


def _few_rows_tile_n() -> int:
    return 32 if INTERPRETED else FEW_ROWS_TILES["BN"]


def split_count(n: int, num_blocks: int, programs: int) -> int:
    """How many K splits give about ``programs`` programs of ``_few_rows_tile_n()`` columns (each split at least
    ``MIN_BLOCKS_PER_SPLIT`` K tiles), with no split's block range empty."""
    tiles = triton.cdiv(n, _few_rows_tile_n())
    splits = max(1, min(num_blocks // MIN_BLOCKS_PER_SPLIT, triton.cdiv(programs, tiles)))
    return triton.cdiv(num_blocks, triton.cdiv(num_blocks, splits))  # every split gets at least one block


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split GEMM's per-column-tile arrival counters: zero between calls (each call's last split zeroes its
    own), so one buffer per device serves every call in stream order, graph replays included. A wider call gets a
    larger buffer; the smaller ones stay allocated, since captured graphs hold their addresses."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        buffers.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter: enough to split the tests' small shapes
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs_wanted(device: torch.device) -> int:
    return FEW_ROWS_PROGRAMS_PER_SM * _sm_count(device)


@functools.cache
def _tuned_gemm():
    """The GEMM autotuned once per (token-count bucket, N, K)."""
    return triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"],
                           prune_configs_by={"early_config_prune": _prune})(_fp8_gemm_kernel)


def _fp32_scales(scale: torch.Tensor) -> torch.Tensor:
    """The e8m0 tile scales as fp32 (what the kernel reads), converted once per weight rather than per call.

    The copy hangs on the scale tensor itself, so it lives and dies with that weight (weights do not change once
    loaded); a cache keyed by address could hand a freed weight's scales to a new one.
    """
    cached = getattr(scale, "_deepinfer_fp32", None)
    if cached is None:
        cached = scale._deepinfer_fp32 = scale.float().contiguous()
    return cached


def deep_gemm_serves(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, activation_block: int) -> bool:
    """DeepGEMM's SM90 FP8 GEMM: bf16 activations in 1 x 128 blocks against 128 x 128 weight tiles (V4's FP8
    checkpoints; V4.1's 32 x 32 tiles are not among its recipes)."""
    n, k = weight.shape
    return (x.dtype == torch.bfloat16 and activation_block == 128 and k % 128 == 0 and n % 64 == 0
            and infer_block(n, scale.shape[0]) == 128 and infer_block(k, scale.shape[1]) == 128)


def deep_gemm_linear(deep_gemm, x, weight, scale):
    """``fp8_linear`` through DeepGEMM: the same activation rounding (``act_quant``), DeepGEMM's GEMM."""
    n, k = weight.shape
    flat = x.reshape(-1, k).contiguous()
    y = torch.empty(flat.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if flat.shape[0]:
        deep_gemm.fp8_gemm_nt(act_quant(flat, 128), (weight, _fp32_scales(scale)), y)
    return y.view(*x.shape[:-1], n)


class TritonLinear:
    """Triton's block-FP8 GEMM; DeepGEMM's for the shapes it serves where build.sh provisioned it."""

    name = "triton-fp8"
    graph_safe = True

    def __init__(self, deep_gemm=None, pinned: bool = False):
        self.deep_gemm = deep_gemm  # the deep_gemm module, or None
        self.pinned = pinned  # one tile configuration for every token count (batch-invariant mode)
        self.batch_invariant = pinned and deep_gemm is None
        if pinned:
            self.name = "triton-fp8, pinned tiles (batch-invariant)"

    def linear(self, x, weight, scale, activation_block):
        if weight.dtype == torch.float8_e4m3fn:
            if self.deep_gemm is not None and deep_gemm_serves(x, weight, scale, activation_block):
                return deep_gemm_linear(self.deep_gemm, x, weight, scale)
            return fp8_linear(x, weight, scale, activation_block, self.pinned)
        log_once(logger, logging.WARNING, "MXFP4 dense projections: no Triton kernel yet, the torch reference multiplies them")
        return blockwise_linear(x, weight, scale, activation_block)

    def logits(self, hidden, weight):
        if weight.dtype == torch.bfloat16:
            return bf16_logits(hidden.float(), weight, self.pinned)
        return fp32_logits(hidden, weight)  # fp32 heads: one GEMM; fp16 ones: the reference's slabs
