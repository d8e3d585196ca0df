"""Block-scaled FP8 GEMM in Triton: ``y = x W^T`` for an e4m3 weight [N, K] with e8m0 tile scales.

Two kernels, as the release's GEMMs work: ``act_quant`` rounds ``x`` to e4m3 with one power-of-two scale per
``1 x BK`` segment (bit-exact with ``deepinfer.core.quantization.round_fp8``), then ``fp8_gemm`` multiplies one
``BK``-deep tile at a time on the tensor cores and adds each tile's fp32 partial product times both scales. On
Hopper an fp8 MMA accumulates in reduced precision, so promoting every BK = 32 or 128 values keeps the sum exact
to fp32 rounding. ``BK`` is the activation block, which equals the weight's column tile (the loader checks the
scales against ``quantization_config.weight_block_size``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from deepinfer.core.ops import fp32_logits
from deepinfer.core.quantization import blockwise_linear, infer_block
from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia.logits import bf16_logits

logger = init_logger(__name__)


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


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, num_blocks, BLOCK: tl.constexpr,
                      ROWS: tl.constexpr, SEGMENTS: tl.constexpr, NATIVE_FP8: tl.constexpr,
                      ROUND_TRIP: tl.constexpr = False, PAIRS_APART: tl.constexpr = False):
    """ROWS rows x SEGMENTS segments of BLOCK columns per program, each segment scaled on its own. ROUND_TRIP:
    ``q`` gets the rounded values times their scales, in its own dtype (exact in bf16), and no scales.
    PAIRS_APART: each 32 columns of ``q`` hold their even columns, then their odd ones (what the MXFP4 experts'
    MMAs read: a packed weight byte holds an even and an odd column's codes)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    segments = tl.program_id(1) * SEGMENTS + tl.arange(0, SEGMENTS)
    offs = segments[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [SEGMENTS, BLOCK] columns
    rows_ok = rows < M
    mask = rows_ok[:, None, None] & (offs < K)[None, :, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None, None] * stride_x + offs[None, :, :], mask=mask,
                other=0.0).to(tl.float32)
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
ACT_QUANT_VALUES, ACT_QUANT_VALUES_FEW_ROWS, FEW_ROWS = 4096, 512, 64


def _configs() -> list[triton.Config]:
    shapes = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 3),
              (128, 128, 8, 3), (128, 64, 4, 3)]
    return [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in shapes]


def _prune(configs, named_args, **kwargs):
    """Row tiles no taller than the (bucketed) token count: decode steps get 16-row tiles."""
    fitting = [c for c in configs if c.kwargs["BM"] <= max(16, named_args["M_BUCKET"])]
    return fitting or configs[:1]


@triton.jit
def _fp8_gemm_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K, M_BUCKET, stride_q, stride_w, stride_sw,
                     stride_y, stride_split, NUM_BLOCKS: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
                     W_ROW_TILE: tl.constexpr, BK: tl.constexpr, NATIVE_FP8: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, QUANTIZE: tl.constexpr = False):
    """One [BM, BN] tile of ``y``; split over K (program axis 2), each split's fp32 partial sum goes to its own
    slab of ``y`` (``stride_split`` apart) for ``_sum_splits_kernel``. With QUANTIZE, ``q_ptr`` holds the
    unrounded activations and each program rounds its tiles itself, as ``act_quant`` would (bit for bit): one launch
    fewer per call, worth it while the activations are a few rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = tl.program_id(2) * BLOCKS_PER_SPLIT
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for step in range(BLOCKS_PER_SPLIT):  # the last split's surplus steps load nothing
        block = first + step
        k = block * BK + offs_k
        k_ok = k < K
        scale_block = tl.minimum(block, NUM_BLOCKS - 1)  # surplus steps: a real scale times their zero products
        a = tl.load(q_ptr + offs_m[:, None] * stride_q + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANTIZE:
            sx = _segment_scale(tl.max(tl.abs(a.to(tl.float32)), axis=1))
            a = _e4m3_values(a.to(tl.float32), sx[:, None], NATIVE_FP8).to(tl.float8e4nv)
        else:
            sx = tl.load(sx_ptr + offs_m * NUM_BLOCKS + scale_block, mask=m_ok, other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if NATIVE_FP8:
            part = tl.dot(a, tl.trans(b))
        else:  # the interpreter (and pre-Hopper GPUs) multiply the same values in fp32
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        sw = tl.load(sw_ptr + (offs_n // W_ROW_TILE) * stride_sw + scale_block, mask=n_ok, other=0.0)
        acc += part * sx[:, None] * sw[None, :]
    tl.store(y_ptr + tl.program_id(2) * stride_split + offs_m[:, None] * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(partial_ptr, y_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``y`` = the splits' partial sums added in split order (the same order every call: deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(partial_ptr + split * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _act_quant(x: torch.Tensor, block: int, q: torch.Tensor, scales: torch.Tensor | None,
               pairs_apart: bool = False) -> None:
    rows, cols = x.shape
    num_blocks = triton.cdiv(cols, block)
    if not rows:
        return
    values = ACT_QUANT_VALUES if rows > FEW_ROWS else ACT_QUANT_VALUES_FEW_ROWS
    segments = min(triton.next_power_of_2(num_blocks), max(1, values // block))
    tile_rows = min(triton.next_power_of_2(rows), max(1, values // (segments * block)))
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(num_blocks, segments))
    # a round trip writes no scales: its s_ptr is never stored to
    _act_quant_kernel[grid](x, q, q if scales is None else scales, rows, cols, x.stride(0), q.stride(0), num_blocks,
                            BLOCK=block, ROWS=tile_rows, SEGMENTS=segments, NATIVE_FP8=_native_fp8(x.device),
                            ROUND_TRIP=scales is None, PAIRS_APART=pairs_apart)


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
    splits = 1 if pinned else split_count(m, n, num_blocks, _programs_wanted(x.device))
    fused = splits > 1 and ROUND_IN_SPLIT_GEMM  # split calls (a few rows) round their activations in the GEMM
    q, sx = (flat, flat) if fused else act_quant(flat, activation_block)
    # the interpreter cannot time configurations: it runs the smallest tile
    if splits > 1 or _INTERPRETED:
        kernel, tiles = _fp8_gemm_kernel, SPLIT_TILES if not _INTERPRETED else {"BM": 16, "BN": 32}
    else:
        kernel, tiles = (_fp8_gemm_kernel, PINNED_TILES) if pinned else (_tuned_gemm(), {})
    per_split = triton.cdiv(num_blocks, splits)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]), splits

    kernel[grid](q, sx, weight, _fp32_scales(scale), out, m, n, k, min(triton.next_power_of_2(m), 128), q.stride(0),
                 weight.stride(0), scale.shape[1], n, m * n, NUM_BLOCKS=num_blocks, BLOCKS_PER_SPLIT=per_split,
                 W_ROW_TILE=infer_block(n, scale.shape[0]), BK=activation_block, NATIVE_FP8=_native_fp8(x.device),
                 QUANTIZE=fused, **tiles)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](out, y, m * n, SPLITS=splits, BLOCK=1024)
    return y.view(*x.shape[:-1], n)


# Decode-sized calls (a few rows) have a handful of column tiles, each looping over all of K: a 1536 x 5120
# projection is 12 programs on a 132-SM GPU. Splitting K gives every SM work; the partial sums cost one more
# launch and m x n x splits fp32 values, which only pays while m is small.
SPLIT_MAX_ROWS = 64
ROUND_IN_SPLIT_GEMM = True  # False: act_quant's launch first, as for larger calls (the tests compare the two)
SPLIT_TILES = {"BM": 16, "BN": 128, "num_warps": 4, "num_stages": 6}
MIN_BLOCKS_PER_SPLIT = 4


def split_count(m: int, n: int, num_blocks: int, programs: int) -> int:
    """How many K splits give about ``programs`` programs (each split at least ``MIN_BLOCKS_PER_SPLIT`` K tiles),
    with no two splits' block ranges empty."""
    if m > SPLIT_MAX_ROWS:
        return 1
    tile_n = 32 if _INTERPRETED else SPLIT_TILES["BN"]
    tiles = triton.cdiv(m, 16) * triton.cdiv(n, tile_n)
    splits = max(1, min(num_blocks // MIN_BLOCKS_PER_SPLIT, triton.cdiv(programs, tiles)))
    return triton.cdiv(num_blocks, triton.cdiv(num_blocks, splits))  # every split gets at least one block


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter: enough to split the tests' small shapes
        return 8
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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


@functools.cache  # asked twice per projection per step; the answer never changes
def _native_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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
