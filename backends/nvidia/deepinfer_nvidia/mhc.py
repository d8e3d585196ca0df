"""mHC in Triton: the coefficients in one launch (the sigmoids and the whole Sinkhorn loop of each token in
registers), the streams' collapse and expansion in one launch each.

The reference spends ~120 kernel launches per coefficients call on [T, 4, 4] matrices (softmax, then 20 rounds of
two normalisations), and the model calls it twice per layer: at decode that launch count, not arithmetic, is the
cost. Here one program takes a block of tokens, keeps their n x n matrices in registers and unrolls the iterations.
The collapse (a weighted sum of the n streams) and the expansion (the mix of the old streams plus the sublayer's
output) are a few element-wise torch ops each; here each is one pass over the streams in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def _mhc_kernel(logits_ptr, stride_l, pre_ptr, post_ptr, comb_ptr, T, eps, N: tl.constexpr, ITERS: tl.constexpr,
                BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    i = tl.arange(0, N)
    base = logits_ptr + rows.to(tl.int64) * stride_l
    pre = tl.sigmoid(tl.load(base[:, None] + i[None, :], mask=ok[:, None], other=0.0)) + eps
    post = 2 * tl.sigmoid(tl.load(base[:, None] + N + i[None, :], mask=ok[:, None], other=0.0))
    cell = i[:, None] * N + i[None, :]  # [N, N]: row-major position of comb[r, c]
    x = tl.load(base[:, None, None] + 2 * N + cell[None, :, :], mask=ok[:, None, None], other=0.0)
    e = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    tl.store(pre_ptr + rows[:, None] * N + i[None, :], pre, mask=ok[:, None])
    tl.store(post_ptr + rows[:, None] * N + i[None, :], post, mask=ok[:, None])
    tl.store(comb_ptr + rows[:, None, None] * (N * N) + cell[None, :, :], comb, mask=ok[:, None, None])


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
def _collapse_kernel(streams_ptr, stride_st, stride_sn, pre_ptr, weight_ptr, out_ptr, stride_out, D, eps,
                     N: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """One token's row: the pre-weighted sum of its streams, RMS-normalized and scaled by the weight with NORM
    (a first pass over the row for the sum of squares; the second recomputes the sum, cheaper than keeping it)."""
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    pre = tl.load(pre_ptr + token * N + i)
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


class TritonMHC:
    name = "triton"
    graph_safe = True
    batch_invariant = True  # one token's reductions per program

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        n = hc_mult
        if n & (n - 1) or sinkhorn_iters < 1:
            raise ValueError(f"the Triton mHC kernel needs a power-of-two hc_mult and sinkhorn_iters >= 1, got "
                             f"{hc_mult} and {sinkhorn_iters}")
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

    def collapse(self, streams, pre, norm_weight=None, eps=0.0):
        streams, pre = _checked(streams, pre)
        tokens, n, width = streams.shape
        norm = norm_weight is not None
        if norm and norm_weight.dtype != torch.float32:
            raise ValueError(f"the input norm's weight must be fp32, got {norm_weight.dtype}")
        weight = norm_weight.contiguous() if norm else pre  # unread without the norm
        out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
        if tokens:
            _collapse_kernel[(tokens,)](streams, streams.stride(0), streams.stride(1), pre, weight, out, out.stride(0),
                                        width, eps, N=n, BLOCK_D=_block_d(width), NORM=norm)
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
