"""mHC's weights in Triton: a sublayer's pre, post and comb coefficients from its streams, in two launches (the
logits' projection onto fn split over K, then the splits' sum, the sigmoids and the whole Sinkhorn loop of each
token in registers), or from logits already computed in one. ``mhc.py`` collapses and expands the streams with them
and runs the launches of a V4 sublayer's input, whose second launch also collapses.

The reference spends ~120 kernel launches per coefficients call on [T, 4, 4] matrices (softmax, then 20 rounds of
two normalisations), and the model calls it twice per layer: at decode that launch count, not arithmetic, is the
cost. Here a program keeps its tokens' n x n matrices in registers and unrolls the iterations. The logits before
it (an RMS norm, a GEMV against fn [(2 + n) n, n D], scales and bias: 6 more launches in torch) become one split-K
launch: at batch 1 reading fn (1.5 MB for flash) is the work, so it is spread over up to 64 programs. On an H200 at
flash's sizes, in a CUDA graph, a sublayer's weights take ~10 us at batch 1 instead of ~23 (the same at 37 tokens).
Prefill chunks of 256+ tokens multiply tiles of 64 tokens instead (``_mix_tiles_kernel``; not batch invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

BLOCK_T = 16
# The logits' projection is cut into at most this many K-splits of whole BLOCK_K columns. The cut depends on the
# width alone, never on the token count: a token's sum is then added in the same order in any batch. One block a
# split (256) was slower at batch 1 (H100, V4-shaped sublayer input at V4.1-Flash's width: 14.9 -> 16.3 us a call;
# 41.7 -> 38.1 at 64 tokens): the second launch's sum over the splits grows with them.
MAX_SPLITS = 64
BLOCK_K = 128
# A prefill's projection: tokens per program, and about how many programs to launch (two per SM of an H200)
PREFILL_TILE_T, PREFILL_PROGRAMS = 64, 264


@triton.jit
def _coefficients(pre, post, comb, eps, N: tl.constexpr, ITERS: tl.constexpr):
    """``pre``, ``post`` [BLOCK_T, N] and ``comb`` [BLOCK_T, N, N] logits -> the coefficients."""
    pre = tl.sigmoid(pre) + eps
    post = 2 * tl.sigmoid(post)
    e = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    return pre, post, comb


@triton.jit
def _store_mix(post, comb, rows, ok, post_ptr, comb_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    cell = i[:, None] * N + i[None, :]  # [N, N]: row-major position of comb[r, c]
    tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + cell[None, :, :], comb, mask=ok[:, None, None])


@triton.jit
def _store_coefficients(pre, post, comb, rows, ok, pre_ptr, post_ptr, comb_ptr, eps, N: tl.constexpr,
                        ITERS: tl.constexpr):
    """``pre``, ``post`` [BLOCK_T, N] and ``comb`` [BLOCK_T, N, N] logits -> the coefficients, stored."""
    pre, post, comb = _coefficients(pre, post, comb, eps, N, ITERS)
    tl.store(pre_ptr + rows[:, None] * N + tl.arange(0, N)[None, :], pre, mask=ok[:, None])
    _store_mix(post, comb, rows, ok, post_ptr, comb_ptr, N)


@triton.jit
def _mhc_kernel(logits_ptr, stride_l, pre_ptr, post_ptr, comb_ptr, T, eps, N: tl.constexpr, ITERS: tl.constexpr,
                BLOCK_T: tl.constexpr):
    wait_for_inputs()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    i = tl.arange(0, N)
    cell = i[:, None] * N + i[None, :]
    base = logits_ptr + rows.to(tl.int64) * stride_l
    pre = tl.load(base[:, None] + i[None, :], mask=ok[:, None], other=0.0)
    post = tl.load(base[:, None] + N + i[None, :], mask=ok[:, None], other=0.0)
    comb = tl.load(base[:, None, None] + 2 * N + cell[None, :, :], mask=ok[:, None, None], other=0.0)
    _store_coefficients(pre, post, comb, rows, ok, pre_ptr, post_ptr, comb_ptr, eps, N, ITERS)


@triton.jit
def _token_partials(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, tile, split, splits,
                    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCKS_PER_SPLIT: tl.constexpr):
    """Split ``split``'s share (of ``splits``), BLOCKS_PER_SPLIT blocks of BLOCK_K columns of the flat streams, of
    the projection onto fn's M rows (dots [T, splits, M]) and of the sum of squares (squares [T, splits]) of each
    token of ``tile``, in fp32.

    One token at a time, products summed element-wise over the blocks and reduced once: a decode step's few tokens
    cost only their own arithmetic (a 16-row tl.dot would multiply the padding too), and the program's fn columns,
    read from memory for its first token, come from the L1 cache for the others."""
    m = tl.arange(0, M_PAD)
    for t in range(BLOCK_T):
        row = tile * BLOCK_T + t
        if row < T:
            products = tl.zeros((M_PAD, BLOCK_K), tl.float32)
            squares = tl.zeros((BLOCK_K,), tl.float32)
            for block in range(BLOCKS_PER_SPLIT):
                cols = (split * BLOCKS_PER_SPLIT + block) * BLOCK_K + tl.arange(0, BLOCK_K)
                in_row = cols < K
                x = tl.load(streams_ptr + row.to(tl.int64) * stride_st + cols, mask=in_row, other=0.0).to(tl.float32)
                w = tl.load(fn_ptr + m[:, None] * K + cols[None, :], mask=(m[:, None] < M) & in_row[None, :],
                            other=0.0)
                products += w * x[None, :]
                squares += x * x
            at = row.to(tl.int64) * splits + split
            tl.store(dots_ptr + at * M + m, tl.sum(products, axis=1), mask=m < M)
            tl.store(squares_ptr + at, tl.sum(squares, axis=0))


@triton.jit(do_not_specialize=["T"])  # counts of a step's rows: one binary for any
def _mix_partials_kernel(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, M: tl.constexpr,
                         M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCKS_PER_SPLIT: tl.constexpr):
    """``_token_partials`` of token tile ``program_id(0)`` and split ``program_id(1)``."""
    wait_for_inputs()
    _token_partials(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, tl.program_id(0), tl.program_id(1),
                    tl.num_programs(1), M, M_PAD, BLOCK_T, BLOCK_K, BLOCKS_PER_SPLIT)


@triton.jit(do_not_specialize=["T"])  # counts of a step's rows: one binary for any
def _mix_tiles_kernel(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, M: tl.constexpr,
                      M_PAD: tl.constexpr, TILE_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCKS_PER_SPLIT: tl.constexpr):
    """``_mix_partials_kernel``'s outputs for a prefill's many tokens: TILE_T tokens a program, their products with
    fn's rows as tl.dot tiles read from the bf16 streams without an fp32 copy. tf32x3 keeps fp32's accuracy (each
    operand split into two TF32 parts, three tensor-core products) where IEEE fp32 would fall back to FMAs."""
    wait_for_inputs()
    rows = tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)
    rows_ok = rows < T
    split = tl.program_id(1)
    m = tl.arange(0, M_PAD)
    dots = tl.zeros((TILE_T, M_PAD), tl.float32)
    squares = tl.zeros((TILE_T,), tl.float32)
    for block in range(BLOCKS_PER_SPLIT):
        cols = (split * BLOCKS_PER_SPLIT + block) * BLOCK_K + tl.arange(0, BLOCK_K)
        in_row = cols < K
        x = tl.load(streams_ptr + rows.to(tl.int64)[:, None] * stride_st + cols[None, :],
                    mask=rows_ok[:, None] & in_row[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + cols[None, :], mask=(m[:, None] < M) & in_row[None, :], other=0.0)
        dots = tl.dot(x, tl.trans(w), dots, input_precision="tf32x3")
        squares += tl.sum(x * x, axis=1)
    at = rows.to(tl.int64) * tl.num_programs(1) + split
    tl.store(dots_ptr + at[:, None] * M + m[None, :], dots, mask=rows_ok[:, None] & (m[None, :] < M))
    tl.store(squares_ptr + at, squares, mask=rows_ok)


@triton.jit
def _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, token, splits, K, norm_eps, N: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    """One token's splits from ``_mix_partials_kernel`` summed, RMS-scaled, scaled and biased: its pre [1, N], post
    [1, N] and comb [1, N, N] logits. All of a token's splits load at once, summed in one reduction whose order the
    split count alone sets."""
    split = tl.arange(0, SPLITS_PAD)
    present = split < splits
    i = tl.arange(0, N)
    cell = i[:, None] * N + i[None, :]
    dots = dots_ptr + (token * splits + split) * ((2 + N) * N)
    # from L2 (".cg"): in ``mhc._single_pass_input_kernel`` other programs of the same launch wrote them
    pre = tl.sum(tl.load(dots[:, None] + i[None, :], mask=present[:, None], other=0.0, cache_modifier=".cg"), axis=0)
    post = tl.sum(tl.load(dots[:, None] + N + i[None, :], mask=present[:, None], other=0.0, cache_modifier=".cg"),
                  axis=0)
    comb = tl.sum(tl.load(dots[:, None, None] + 2 * N + cell[None, :, :], mask=present[:, None, None], other=0.0,
                          cache_modifier=".cg"), axis=0)
    squares = tl.sum(tl.load(squares_ptr + token * splits + split, mask=present, other=0.0, cache_modifier=".cg"),
                     axis=0)
    rstd = 1.0 / tl.sqrt(squares / K + norm_eps)
    pre = pre * rstd * tl.load(scale_ptr) + tl.load(base_ptr + i)
    post = post * rstd * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i)
    comb = comb * rstd * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cell)
    return pre[None, :], post[None, :], comb[None, :, :]


@triton.jit
def _mhc_weights_kernel(dots_ptr, squares_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, splits, K,
                        norm_eps, eps, N: tl.constexpr, ITERS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One token's coefficients from its ``_mix_partials_kernel`` splits. One token a program: a decode step's
    program does no work for padding rows."""
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    pre, post, comb = _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, token, splits, K, norm_eps, N,
                                     SPLITS_PAD)
    rows = token + tl.arange(0, 1)
    _store_coefficients(pre, post, comb, rows, rows < T, pre_ptr, post_ptr, comb_ptr, eps, N, ITERS)


def _check_sinkhorn(hc_mult: int, sinkhorn_iters: int) -> None:
    if hc_mult & (hc_mult - 1) or sinkhorn_iters < 1:
        raise ValueError(f"the Triton mHC kernel needs a power-of-two hc_mult and sinkhorn_iters >= 1, got "
                         f"{hc_mult} and {sinkhorn_iters}")


def _splits(width: int, wanted: int = MAX_SPLITS) -> tuple[int, int]:
    """(K-splits, BLOCK_K blocks per split) of a token's flat streams ``width`` wide, none empty, at most ``wanted``
    of them (and MAX_SPLITS)."""
    blocks_per_split = triton.cdiv(triton.cdiv(width, BLOCK_K), max(1, min(MAX_SPLITS, wanted)))
    return triton.cdiv(width, blocks_per_split * BLOCK_K), blocks_per_split


def _mix_buffers(streams: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``post`` [T, n] and ``comb`` [T, n, n], fp32, to be written."""
    tokens = streams.shape[0]
    return (torch.empty(tokens, n, dtype=torch.float32, device=streams.device),
            torch.empty(tokens, n, n, dtype=torch.float32, device=streams.device))


def mix_input(streams, fn, base, scale, n: int, sinkhorn_iters: int) -> torch.Tensor | None:
    """The streams [T, n, D] as the logits' projection reads them, flat [T, n D] with unit-stride columns, once
    every input is checked; None without tokens."""
    logits = (2 + n) * n
    _check_sinkhorn(n, sinkhorn_iters)
    if streams.dim() != 3 or streams.shape[1] != n or streams.shape[2] == 0:
        raise ValueError(f"mHC streams must be [T, hc_mult = {n}, D > 0], got {list(streams.shape)}")
    tokens, width = streams.shape[0], n * streams.shape[2]
    if fn.dtype != torch.float32 or not fn.is_contiguous() or fn.shape != (logits, width):
        raise ValueError(f"mHC fn must be contiguous fp32 [(2 + n) n, n D] = [{logits}, {width}], got "
                         f"{'' if fn.is_contiguous() else 'strided '}{fn.dtype} {list(fn.shape)}")
    if (base.dtype, scale.dtype) != (torch.float32,) * 2 or base.shape != (logits,) or scale.shape != (3,):
        raise ValueError(f"mHC base and scale must be fp32 [{logits}] and [3], got {base.dtype} "
                         f"{list(base.shape)} and {scale.dtype} {list(scale.shape)}")
    if not tokens:
        return None
    flat = streams.flatten(1)  # a view unless the streams' channels are strided
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _mix_partials(streams, fn, base, scale, n: int, sinkhorn_iters: int, gemm_tokens: int | None):
    """The first launch of a sublayer's weights: each token's projection onto ``fn`` and its sum of squares, split
    over K. Returns (dots, squares, splits, flat width), or None without tokens.

    From ``gemm_tokens`` tokens on (prefill chunks) ``_mix_tiles_kernel`` multiplies tiles of tokens instead: the
    token-at-a-time products, right for a decode step's few rows, ran at 2.8 TFLOPS on 8192 tokens (1.16 ms a call
    on an H200), and cuBLAS's fp32 GEMM wanted an fp32 copy of the streams (0.78 ms a call with the copy and the
    squares)."""
    flat = mix_input(streams, fn, base, scale, n, sinkhorn_iters)
    if flat is None:
        return None
    logits, (tokens, width) = (2 + n) * n, flat.shape
    tiled = gemm_tokens is not None and tokens >= gemm_tokens
    tiles = triton.cdiv(tokens, PREFILL_TILE_T if tiled else BLOCK_T)
    # decode: a cut set by the width alone; a prefill: just enough splits for ~PREFILL_PROGRAMS programs
    splits, blocks_per_split = _splits(width, triton.cdiv(PREFILL_PROGRAMS, tiles) if tiled else MAX_SPLITS)
    dots = torch.empty(tokens, splits, logits, dtype=torch.float32, device=streams.device)
    squares = torch.empty(tokens, splits, dtype=torch.float32, device=streams.device)
    args = (flat, flat.stride(0), fn, dots, squares, tokens, width)
    if tiled:  # tl.dot wants 16+ columns
        _mix_tiles_kernel[(tiles, splits)](*args, M=logits, M_PAD=max(16, triton.next_power_of_2(logits)),
                                           TILE_T=PREFILL_TILE_T, BLOCK_K=BLOCK_K, BLOCKS_PER_SPLIT=blocks_per_split,
                                           num_warps=8, **LAUNCH)
    else:
        _mix_partials_kernel[(tiles, splits)](*args, M=logits, M_PAD=triton.next_power_of_2(logits), BLOCK_T=BLOCK_T,
                                              BLOCK_K=BLOCK_K, BLOCKS_PER_SPLIT=blocks_per_split, **LAUNCH)
    return dots, squares, splits, width
