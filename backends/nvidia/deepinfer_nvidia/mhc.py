"""mHC in Triton: a sublayer's weights from its streams in two launches (the logits' projection split over K, then
the splits' sum, the sigmoids and the whole Sinkhorn loop of each token in registers), the streams' collapse and
expansion in one launch each; a V4 sublayer's input (weights, then the collapse with their ``pre``) in two, the
second launch doing both per token.

The reference spends ~120 kernel launches per coefficients call on [T, 4, 4] matrices (softmax, then 20 rounds of
two normalisations), and the model calls it twice per layer: at decode that launch count, not arithmetic, is the
cost. Here a program keeps its tokens' n x n matrices in registers and unrolls the iterations. The logits before
it (an RMS norm, a GEMV against fn [(2 + n) n, n D], scales and bias: 6 more launches in torch) become one split-K
launch: at batch 1 reading fn (1.5 MB for flash) is the work, so it is spread over up to 64 programs. On an H200 at
flash's sizes, in a CUDA graph, a sublayer's weights take ~10 us at batch 1 instead of ~23 (the same at 37 tokens).
Prefill chunks of 256+ tokens multiply tiles of 64 tokens instead (``_mix_tiles_kernel``; not batch invariant).
The collapse (a weighted sum of the n streams) and the expansion (the mix of the old streams plus the sublayer's
output) are a few element-wise torch ops each; here each is one pass over the streams in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
# The logits' projection is cut into at most this many K-splits of whole BLOCK_K columns. The cut depends on the
# width alone, never on the token count: a token's sum is then added in the same order in any batch.
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
def _mix_partials_kernel(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, M: tl.constexpr,
                         M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCKS_PER_SPLIT: tl.constexpr):
    """Split ``program_id(1)``'s share, BLOCKS_PER_SPLIT blocks of BLOCK_K columns of the flat streams, of each
    token's projection onto fn's M rows (dots [T, S, M]) and of its sum of squares (squares [T, S]), in fp32.

    One token at a time, products summed element-wise over the blocks and reduced once: a decode step's few tokens
    cost only their own arithmetic (a 16-row tl.dot would multiply the padding too), and the program's fn columns,
    read from memory for its first token, come from the L1 cache for the others."""
    split = tl.program_id(1)
    m = tl.arange(0, M_PAD)
    for t in range(BLOCK_T):
        row = tl.program_id(0) * BLOCK_T + t
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
            at = row.to(tl.int64) * tl.num_programs(1) + split
            tl.store(dots_ptr + at * M + m, tl.sum(products, axis=1), mask=m < M)
            tl.store(squares_ptr + at, tl.sum(squares, axis=0))


@triton.jit
def _mix_tiles_kernel(streams_ptr, stride_st, fn_ptr, dots_ptr, squares_ptr, T, K, M: tl.constexpr,
                      M_PAD: tl.constexpr, TILE_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCKS_PER_SPLIT: tl.constexpr):
    """``_mix_partials_kernel``'s outputs for a prefill's many tokens: TILE_T tokens a program, their products with
    fn's rows as tl.dot tiles read from the bf16 streams without an fp32 copy. tf32x3 keeps fp32's accuracy (each
    operand split into two TF32 parts, three tensor-core products) where IEEE fp32 would fall back to FMAs."""
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
    pre = tl.sum(tl.load(dots[:, None] + i[None, :], mask=present[:, None], other=0.0), axis=0)
    post = tl.sum(tl.load(dots[:, None] + N + i[None, :], mask=present[:, None], other=0.0), axis=0)
    comb = tl.sum(tl.load(dots[:, None, None] + 2 * N + cell[None, :, :], mask=present[:, None, None], other=0.0),
                  axis=0)
    squares = tl.sum(tl.load(squares_ptr + token * splits + split, mask=present, other=0.0), axis=0)
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
    token = tl.program_id(0).to(tl.int64)
    pre, post, comb = _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, token, splits, K, norm_eps, N,
                                     SPLITS_PAD)
    rows = token + tl.arange(0, 1)
    _store_coefficients(pre, post, comb, rows, rows < T, pre_ptr, post_ptr, comb_ptr, eps, N, ITERS)


@triton.jit
def _streams_tile(streams_ptr, stride_st, stride_sn, token, start, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Channels ``start ..`` of ``token``'s N streams: their offsets, which exist, and the tile [N, BLOCK_D] in
    fp32."""
    offs = start + tl.arange(0, BLOCK_D)
    ok = offs < D
    streams = tl.load(streams_ptr + token * stride_st + tl.arange(0, N)[:, None] * stride_sn + offs[None, :],
                      mask=ok[None, :], other=0.0).to(tl.float32)
    return offs, ok, streams


@triton.jit
def _collapse_row(streams_ptr, stride_st, stride_sn, token, pre, weight_ptr, out_ptr, stride_out, D, eps,
                  N: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, ONE_PASS: tl.constexpr):
    """``token``'s row: the ``pre`` [N] weighted sum of its streams, RMS-normalized and scaled by the weight with
    NORM. ONE_PASS (BLOCK_D >= D): the row stays in registers, one read of the streams. Otherwise a first pass
    over the row for the sum of squares and a second that recomputes the sum, cheaper than keeping it."""
    if ONE_PASS:
        offs, ok, streams = _streams_tile(streams_ptr, stride_st, stride_sn, token, 0, D, N, BLOCK_D)
        out = tl.sum(pre[:, None] * streams, axis=0)
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(out * out, axis=0) / D + eps)
            out = out * rstd * tl.load(weight_ptr + offs, mask=ok, other=0.0)
        tl.store(out_ptr + token * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        rstd = 1.0
        if NORM:
            squares = tl.zeros((BLOCK_D,), tl.float32)
            start = 0
            while start < D:  # while loops: the interpreter's range() wants constexpr bounds
                _, _, streams = _streams_tile(streams_ptr, stride_st, stride_sn, token, start, D, N, BLOCK_D)
                collapsed = tl.sum(pre[:, None] * streams, axis=0)
                squares += collapsed * collapsed
                start += BLOCK_D
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / D + eps)
        start = 0
        while start < D:
            offs, ok, streams = _streams_tile(streams_ptr, stride_st, stride_sn, token, start, D, N, BLOCK_D)
            out = tl.sum(pre[:, None] * streams, axis=0)
            if NORM:
                out = out * rstd * tl.load(weight_ptr + offs, mask=ok, other=0.0)
            tl.store(out_ptr + token * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)
            start += BLOCK_D


@triton.jit
def _collapse_kernel(streams_ptr, stride_st, stride_sn, pre_ptr, weight_ptr, out_ptr, stride_out, D, eps,
                     N: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, ONE_PASS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pre = tl.load(pre_ptr + token * N + tl.arange(0, N))
    _collapse_row(streams_ptr, stride_st, stride_sn, token, pre, weight_ptr, out_ptr, stride_out, D, eps, N, BLOCK_D,
                  NORM, ONE_PASS)


@triton.jit
def _sublayer_input_kernel(dots_ptr, squares_ptr, base_ptr, scale_ptr, streams_ptr, stride_st, stride_sn, weight_ptr,
                           out_ptr, stride_out, post_ptr, comb_ptr, T, splits, K, D, norm_eps, hc_eps, eps,
                           N: tl.constexpr, ITERS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                           NORM: tl.constexpr, ONE_PASS: tl.constexpr):
    """``_mhc_weights_kernel`` and ``_collapse_kernel`` in one program per token: ``pre`` stays in registers."""
    token = tl.program_id(0).to(tl.int64)
    pre, post, comb = _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, token, splits, K, norm_eps, N,
                                     SPLITS_PAD)
    pre, post, comb = _coefficients(pre, post, comb, hc_eps, N, ITERS)
    rows = token + tl.arange(0, 1)
    _store_mix(post, comb, rows, rows < T, post_ptr, comb_ptr, N)
    _collapse_row(streams_ptr, stride_st, stride_sn, token, tl.sum(pre, axis=0), weight_ptr, out_ptr, stride_out, D,
                  eps, N, BLOCK_D, NORM, ONE_PASS)


@triton.jit
def _expand_kernel(streams_ptr, stride_st, stride_sn, output_ptr, stride_o, post_ptr, comb_ptr, out_ptr, D,
                   N: tl.constexpr, BLOCK_D: tl.constexpr):
    """New stream o = post[o] * output + sum_i comb[i, o] * streams[i] (out is contiguous [T, N, D])."""
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    offs, ok, streams = _streams_tile(streams_ptr, stride_st, stride_sn, token, tl.program_id(1) * BLOCK_D, D, N,
                                      BLOCK_D)
    output = tl.load(output_ptr + token * stride_o + offs, mask=ok, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + token * N * N + i[:, None] * N + i[None, :])  # [i, o]
    post = tl.load(post_ptr + token * N + i)
    new = post[:, None] * output[None, :] + tl.sum(comb[:, :, None] * streams[:, None, :], axis=0)
    tl.store(out_ptr + (token * N + i[:, None]) * D + offs[None, :], new.to(out_ptr.dtype.element_ty),
             mask=ok[None, :])


def _checked(streams: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``streams`` and the weights as the kernels read them: unit-stride rows, contiguous fp32 weights."""
    n = streams.shape[1]
    if n & (n - 1):
        raise ValueError(f"the Triton mHC kernels need a power-of-two stream count, got {list(streams.shape)}")
    if any(w.dtype != torch.float32 for w in weights):
        raise ValueError(f"mHC weights (pre, post, comb) must be fp32, got {[w.dtype for w in weights]}")
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    return (streams, *(w.contiguous() for w in weights))


def _block_d(width: int) -> int:
    return min(1024, triton.next_power_of_2(width))


# A collapse keeps a row of up to this many channels in registers (n x 8192 fp32 over 16 warps: 64 a thread) and
# reads its streams once. Two passes of 1024-channel tiles took 6 µs a call for V4.1-Flash's 5120 channels at batch
# 1 on an H200: ten dependent rounds of loads for one program.
ONE_PASS_MAX_WIDTH = 8192


def _collapse_tiles(width: int) -> dict:
    """``_collapse_row``'s BLOCK_D, ONE_PASS and warps for rows ``width`` wide."""
    if triton.next_power_of_2(width) <= ONE_PASS_MAX_WIDTH:
        block = triton.next_power_of_2(width)
        return {"BLOCK_D": block, "ONE_PASS": True, "num_warps": 16 if block >= 4096 else 4}
    return {"BLOCK_D": _block_d(width), "ONE_PASS": False}


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


def _mix_partials(streams, fn, base, scale, n: int, sinkhorn_iters: int, gemm_tokens: int | None):
    """The first launch of a sublayer's weights: each token's projection onto ``fn`` and its sum of squares, split
    over K. Returns (dots, squares, splits, flat width), or None without tokens.

    From ``gemm_tokens`` tokens on (prefill chunks) ``_mix_tiles_kernel`` multiplies tiles of tokens instead: the
    token-at-a-time products, right for a decode step's few rows, ran at 2.8 TFLOPS on 8192 tokens (1.16 ms a call
    on an H200), and cuBLAS's fp32 GEMM wanted an fp32 copy of the streams (0.78 ms a call with the copy and the
    squares)."""
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
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
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
                                           num_warps=8)
    else:
        _mix_partials_kernel[(tiles, splits)](*args, M=logits, M_PAD=triton.next_power_of_2(logits), BLOCK_T=BLOCK_T,
                                              BLOCK_K=BLOCK_K, BLOCKS_PER_SPLIT=blocks_per_split)
    return dots, squares, splits, width


def _collapse_inputs(streams: torch.Tensor, norm_weight: torch.Tensor | None):
    """The streams with unit-stride channels, the norm's weight (None without) and whether there is one."""
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    if norm_weight is None:
        return streams, None, False
    if norm_weight.dtype != torch.float32:
        raise ValueError(f"the input norm's weight must be fp32, got {norm_weight.dtype}")
    return streams, norm_weight.contiguous(), True


GEMM_TOKENS = 256  # from this many tokens on, a sublayer's projection onto fn multiplies tiles (_mix_tiles_kernel)


class TritonMHC:
    name = "triton"
    graph_safe = True

    def __init__(self, gemm_tokens: int | None = GEMM_TOKENS):
        self.gemm_tokens = gemm_tokens
        # a token's reductions in one program each, or in splits cut by the width alone; with the GEMM, how a
        # token's projection is summed depends on how many tokens share its call
        self.batch_invariant = gemm_tokens is None

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        n = hc_mult
        _check_sinkhorn(n, sinkhorn_iters)
        if logits.dtype != torch.float32 or logits.stride(-1) != 1:
            raise ValueError(f"mHC logits must be fp32 with unit-stride rows, got {logits.dtype}, {logits.stride()}")
        tokens = logits.shape[0]
        pre = torch.empty(tokens, n, dtype=torch.float32, device=logits.device)
        post = torch.empty_like(pre)
        comb = torch.empty(tokens, n, n, dtype=torch.float32, device=logits.device)
        if tokens:
            _mhc_kernel[(triton.cdiv(tokens, BLOCK_T),)](logits, logits.stride(0), pre, post, comb, tokens, eps, N=n,
                                                        ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T)
        return pre, post, comb

    def weights(self, streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps):
        n = hc_mult
        post, comb = _mix_buffers(streams, n)
        pre = torch.empty_like(post)
        partials = _mix_partials(streams, fn, base, scale, n, sinkhorn_iters, self.gemm_tokens)
        if partials is not None:
            dots, squares, splits, width = partials
            _mhc_weights_kernel[(streams.shape[0],)](dots, squares, base.contiguous(), scale.contiguous(), pre, post,
                                                     comb, streams.shape[0], splits, width, norm_eps, hc_eps, N=n,
                                                     ITERS=sinkhorn_iters, SPLITS_PAD=triton.next_power_of_2(splits),
                                                     num_warps=1)
        return pre, post, comb

    def sublayer_input(self, streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps, norm_weight=None,
                       eps=0.0):
        n = hc_mult
        post, comb = _mix_buffers(streams, n)  # no pre: the kernel keeps it in registers
        partials = _mix_partials(streams, fn, base, scale, n, sinkhorn_iters, self.gemm_tokens)
        streams, weight, norm = _collapse_inputs(streams, norm_weight)
        tokens, _, width = streams.shape
        out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
        if partials is not None:
            dots, squares, splits, flat_width = partials
            _sublayer_input_kernel[(tokens,)](
                dots, squares, base.contiguous(), scale.contiguous(), streams, streams.stride(0), streams.stride(1),
                post if weight is None else weight, out, out.stride(0), post, comb, tokens, splits, flat_width, width,
                norm_eps, hc_eps, eps, N=n, ITERS=sinkhorn_iters, SPLITS_PAD=triton.next_power_of_2(splits),
                NORM=norm, **_collapse_tiles(width))
        return out, post, comb

    def collapse(self, streams, pre, norm_weight=None, eps=0.0):
        streams, pre = _checked(streams, pre)
        _, weight, norm = _collapse_inputs(streams, norm_weight)
        tokens, n, width = streams.shape
        out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
        if tokens:
            _collapse_kernel[(tokens,)](streams, streams.stride(0), streams.stride(1), pre, pre if weight is None else
                                        weight, out, out.stride(0), width, eps, N=n, NORM=norm,
                                        **_collapse_tiles(width))
        return out

    def expand(self, streams, output, post, comb):
        streams, post, comb = _checked(streams, post, comb)
        tokens, n, width = streams.shape
        if output.stride(-1) != 1:
            output = output.contiguous()
        out = torch.empty(tokens, n, width, dtype=output.dtype, device=streams.device)
        if tokens:
            block = _block_d(width)
            _expand_kernel[(tokens, triton.cdiv(width, block))](streams, streams.stride(0), streams.stride(1), output,
                                                                output.stride(0), post, comb, out, width, N=n,
                                                                BLOCK_D=block)
        return out
