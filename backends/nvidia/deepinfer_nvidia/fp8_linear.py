"""Block-scaled FP8 GEMM in Triton: ``y = x W^T`` for an e4m3 weight [N, K] with e8m0 tile scales.

As the release's GEMMs work: ``x`` is rounded to e4m3 with one power-of-two scale per ``1 x BK`` segment
(``act_quant``), then each ``BK``-deep tile is multiplied on the tensor cores and its fp32 partial product added
times both scales. On Hopper an fp8 MMA accumulates in reduced precision, so promoting every BK = 32 or 128 values
keeps the sum exact to fp32 rounding. ``BK`` is the activation block, which equals the weight's column tile (the
loader checks the scales against ``quantization_config.weight_block_size``). Two GEMM kernels: an autotuned one
for many rows (from ``BF16_GEMM_MIN_ROWS`` rows ``fp8_bf16_gemm``'s cuBLAS route serves instead) and
``_fp8_gemm_few_rows_kernel`` for decode's few rows (one row: ``fp8_gemv``; their K splits: ``split_k``).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from deepinfer.runtime.ops import fp32_logits, grouped_dequantized_linear, grouped_product
from deepinfer.runtime.quantization import blockwise_linear, infer_block
from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia import INTERPRETED, fp8_bf16_gemm, fp8_gemv
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import _e4m3_values, _native_fp8, _segment_scale, act_quant
from deepinfer_nvidia.split_k import arrival_counters, sm_count, store_split, sum_splits_kernel
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


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # counts of a step's rows: one binary for any
def _fp8_gemm_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K, M_BUCKET, stride_q, stride_w, stride_sw, stride_y,
                     NUM_BLOCKS: tl.constexpr, W_ROW_TILE: tl.constexpr, BK: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr):
    """One [BM, BN] tile of ``y`` from ``act_quant``'s activations."""
    wait_for_inputs()
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
                    NATIVE_FP8: tl.constexpr, QUANTIZE: tl.constexpr, UNROUNDED: tl.constexpr):
    """One K block's [BN, BM] product, both scales applied (UNROUNDED: bf16 activations as they are, the weight
    widened to bf16, exactly, for bf16 tensor cores; only its scale applied)."""
    k = block * BK + tl.arange(0, BK)
    k_ok = k < K
    scale_block = tl.minimum(block, NUM_BLOCKS - 1)  # surplus blocks: a real scale times their zero products
    a = tl.load(q_ptr + offs_m[:, None] * stride_q + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if UNROUNDED:
        sx = tl.full((a.shape[0],), 1.0, tl.float32)
    elif QUANTIZE:
        sx = _segment_scale(tl.max(tl.abs(a.to(tl.float32)), axis=1))
        a = _e4m3_values(a.to(tl.float32), sx[:, None], NATIVE_FP8).to(tl.float8e4nv)
    else:
        sx = tl.load(sx_ptr + offs_m * NUM_BLOCKS + scale_block, mask=m_ok, other=0.0)
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if UNROUNDED and NATIVE_FP8:
        part = tl.dot(w.to(tl.bfloat16), tl.trans(a))
    elif NATIVE_FP8:
        part = tl.dot(w, tl.trans(a))
    else:
        part = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)))
    sw = tl.load(sw_ptr + (offs_n // W_ROW_TILE) * stride_sw + scale_block, mask=n_ok, other=0.0)
    return part * sw[:, None] * sx[None, :]


@triton.jit(do_not_specialize=["M"])  # counts of a step's rows: one binary for any
def _fp8_gemm_few_rows_kernel(q_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K, stride_q,
                              stride_w, stride_sw, stride_y, group_rows, NUM_BLOCKS: tl.constexpr,
                              BLOCKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr, W_ROW_TILE: tl.constexpr,
                              BK: tl.constexpr, NATIVE_FP8: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                              QUANTIZE: tl.constexpr, SUM_HERE: tl.constexpr, UNROUNDED: tl.constexpr):
    """``y^T``'s [BN, BM] tile for a few rows (a decode step's): the weight's rows on the MMA's M side, which Hopper's
    wgmma wants 64 at a time, and the BM (8 to 64) rows of ``x`` on its N side, so e4m3 meets e4m3 on the FP8
    tensor cores with no conversion and the weights are read once whatever the rows.

    K is split over program axis 1, each split's fp32 partial tile stored apart. With SUM_HERE, each split then
    counts itself in on its column tile's arrival counter; the last to arrive adds the partials in split order
    (deterministic) into ``y`` and zeroes the counter for the next call, so no second launch sums them (while the
    partials are few rows: one program reads them all). With QUANTIZE, ``q_ptr`` holds the unrounded activations
    and each program rounds its own, as ``act_quant`` does (bit for bit); with UNROUNDED they are never rounded.
    Weight rows ``g * group_rows`` on read columns ``g K`` on of ``q`` (a grouped projection; one group when
    ``group_rows >= N``)."""
    wait_for_inputs()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    q_ptr += (pid_n * BN // group_rows).to(tl.int64) * K  # the program's rows' group's slice of the activations
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for step in range(BLOCKS_PER_SPLIT):  # the last split's surplus blocks load nothing
        acc += _few_rows_block(q_ptr, sx_ptr, w_ptr, sw_ptr, split * BLOCKS_PER_SPLIT + step, offs_m, offs_n, m_ok,
                               n_ok, K, stride_q, stride_w, stride_sw, NUM_BLOCKS, W_ROW_TILE, BK, NATIVE_FP8, QUANTIZE,
                               UNROUNDED)
    store_split(acc, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, offs_m, n_ok, m_ok, M, N, stride_y,
                SPLITS, SUM_HERE)


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
                 BK=activation_block, NATIVE_FP8=_native_fp8(x.device), **tiles, **LAUNCH)
    return y.view(*x.shape[:-1], n)


# Decode-sized calls (a few rows) go to _fp8_gemm_few_rows_kernel. Their few column tiles would each loop over all
# of K (a 1536 x 5120 projection is 12 tiles of 128 rows on a 132-SM GPU), so K is split until every SM has work.
FEW_ROWS = 64
# From this many rows a call is cuBLAS's bf16 GEMM on the expanded weight (fp8_bf16_gemm; never in batch-invariant
# mode). Timed, expansion included, against the Triton GEMM over one V4.1-Flash layer's FP8 projections
# (tools/gpu/gpu_fp8_linear.py --rows 32 64 192 512 2048, H100, 2026-12-05): 64 rows 289.0 us vs 191.9 (the few-rows
# kernel), 192 rows 312.6 vs 383.0, 512 rows 387.1 vs 850.9, 2048 rows 925.2 vs 2983.0. Between 64 and 192 rows
# nothing was timed, so the Triton GEMM keeps them.
BF16_GEMM_MIN_ROWS = 192
FEW_ROWS_TILES = {"BN": 64, "num_warps": 4, "num_stages": 4}
FEW_ROWS_PROGRAMS_PER_SM = 4
MIN_BLOCKS_PER_SPLIT = 4
# Up to this many rows (padded to 8 or 16) a call is one launch: the GEMM rounds its activations and its last split
# sums the partials. Beyond, each program's share of the rounding and the last split's serial sum cost more than
# act_quant's and _sum_splits_kernel's launches (measured on the H200 at 64 rows: 1.2-1.5x slower one-launch).
ONE_LAUNCH_MAX_ROWS = 16


def _few_rows_gemm(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, weight_row_tile: int,
                   block: int, y: torch.Tensor, groups: int = 1, unrounded: bool = False) -> None:
    """``y`` = ``flat`` times the weight on the FP8 tensor cores, the activations rounded in ``1 x block`` segments;
    ``unrounded``: bf16 activations as they are, on bf16 tensor cores; ``groups``: as ``fp8_gemv.gemv``'s."""
    m, k, n = flat.shape[0], weight.shape[1], weight.shape[0]
    if fp8_gemv.gemv_serves(flat, weight, weight_row_tile, block):
        return fp8_gemv.gemv(flat, weight, scales, weight_row_tile, block, y, groups, round_x=not unrounded)
    num_blocks = triton.cdiv(k, block)
    tile_n = _few_rows_tile_n()
    splits = split_count(n, num_blocks, _programs_wanted(flat.device))
    per_split = triton.cdiv(num_blocks, splits)
    rows = max(8, triton.next_power_of_2(m))
    one_launch = rows <= ONE_LAUNCH_MAX_ROWS
    q, sx = (flat, flat) if one_launch or unrounded else act_quant(flat, block)
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=flat.device) if splits > 1 else y
    tiles = triton.cdiv(n, tile_n)
    _fp8_gemm_few_rows_kernel[(tiles, splits)](
        q, sx, weight, scales, y, partials, arrival_counters(flat.device, tiles), m, n, k, q.stride(0),
        weight.stride(0), scales.stride(0), y.stride(0), n // groups, NUM_BLOCKS=num_blocks,
        BLOCKS_PER_SPLIT=per_split, SPLITS=splits, W_ROW_TILE=weight_row_tile, BK=block,
        NATIVE_FP8=_native_fp8(flat.device), BM=rows, QUANTIZE=one_launch and not unrounded, SUM_HERE=one_launch,
        UNROUNDED=unrounded, **({"BN": tile_n} if INTERPRETED else FEW_ROWS_TILES), **LAUNCH)
    if splits > 1 and not one_launch:
        sum_splits_kernel[(triton.cdiv(m * n, 1024),)](partials, y, m * n, SPLITS=splits, BLOCK=1024, **LAUNCH)


def _few_rows_tile_n() -> int:
    return 32 if INTERPRETED else FEW_ROWS_TILES["BN"]


def split_count(n: int, num_blocks: int, programs: int) -> int:
    """How many K splits give about ``programs`` programs of ``_few_rows_tile_n()`` columns (each split at least
    ``MIN_BLOCKS_PER_SPLIT`` K tiles), with no split's block range empty."""
    tiles = triton.cdiv(n, _few_rows_tile_n())
    splits = max(1, min(num_blocks // MIN_BLOCKS_PER_SPLIT, triton.cdiv(programs, tiles)))
    return triton.cdiv(num_blocks, triton.cdiv(num_blocks, splits))  # every split gets at least one block


def _programs_wanted(device: torch.device) -> int:
    return FEW_ROWS_PROGRAMS_PER_SM * sm_count(device)


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


# 2 to FEW_ROWS rows of the grouped wo_a through the few-rows kernel on bf16 tensor cores (UNROUNDED): built and
# tested in Triton's interpreter; off (the expanded weight's einsum) until a GPU has run its tests and timed it
GROUPED_FEW_ROWS = False


def grouped_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, pinned: bool = False
                       ) -> torch.Tensor:
    """``LinearBackend.grouped_linear`` for bf16 ``x`` [T, G, C] and an e4m3 ``weight`` [G R, C], the activations
    unrounded and each program's rows reading their group's slice of them: one row through the GEMV, with
    ``GROUPED_FEW_ROWS`` up to ``FEW_ROWS`` through the few-rows kernel on bf16 tensor cores (a speculative
    verification step's rows, a decode batch's), more through cuBLAS on the weight expanded to bf16 (the copy the
    release makes when it loads, here made per call). ``pinned`` (batch-invariant mode): the expanded weight at
    every row count, its einsum tiled by the batch-invariant plugin as before ``wo_a`` stayed in FP8."""
    tokens, groups, cols = x.shape
    n = weight.shape[0]
    row_tile, column_tile = infer_block(n, scale.shape[0]), infer_block(cols, scale.shape[1])
    flat = x.reshape(tokens, groups * cols).contiguous()
    # a program's rows must lie in one group: whole tiles of the kernel's rows a group
    one_row = (tokens == 1 and (n // groups) % fp8_gemv.gemv_tiles()["BN"] == 0
               and fp8_gemv.gemv_serves(flat, weight, row_tile, column_tile))
    few_rows = GROUPED_FEW_ROWS and 1 < tokens <= FEW_ROWS and (n // groups) % _few_rows_tile_n() == 0
    if not pinned and (one_row or few_rows):
        y = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
        _few_rows_gemm(flat, weight, _fp32_scales(scale), row_tile, column_tile, y, groups, unrounded=True)
        return y.view(tokens, groups, n // groups)
    return grouped_product(x, fp8_bf16_gemm.expanded_weight(weight, _fp32_scales(scale), row_tile, column_tile))


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

    def grouped_linear(self, x, weight, scale):
        if weight.dtype == torch.float8_e4m3fn and x.dtype == torch.bfloat16:
            return grouped_fp8_linear(x, weight, scale, self.pinned)
        return grouped_dequantized_linear(x, weight, scale)

    def logits(self, hidden, weight):
        if weight.dtype == torch.bfloat16:
            return bf16_logits(hidden.float(), weight, self.pinned)
        return fp32_logits(hidden, weight)  # fp32 heads: one GEMM; fp16 ones: the reference's slabs
