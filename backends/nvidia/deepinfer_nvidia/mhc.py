"""mHC in Triton: the streams' collapse and expansion in one launch each, and a sublayer's input (its weights, then
the collapse with their ``pre``, or with the previous sublayer's in V4.1) in two, the second launch doing both per
token; ``TritonMHC``, the backend.
The weights themselves (the logits' projection and the Sinkhorn loop) are ``mhc_weights.py``'s kernels.

The collapse (a weighted sum of the n streams) and the expansion (the mix of the old streams plus the sublayer's
output) are a few element-wise torch ops each; here each is one pass over the streams in fp32. So is V4.1's Engram
gate (about 25 torch ops in the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.mhc_weights import (BLOCK_K, BLOCK_T, _check_sinkhorn, _coefficients, _mhc_kernel,
                                          _mhc_weights_kernel, _mix_buffers, _mix_partials, _splits,
                                          _store_coefficients, _store_mix, _summed_logits, _token_partials,
                                          mix_input)
from deepinfer_nvidia.split_k import arrival_counters


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
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    pre = tl.load(pre_ptr + token * N + tl.arange(0, N))
    _collapse_row(streams_ptr, stride_st, stride_sn, token, pre, weight_ptr, out_ptr, stride_out, D, eps, N, BLOCK_D,
                  NORM, ONE_PASS)


@triton.jit(do_not_specialize=["T"])  # counts of a step's rows: one binary for any
def _sublayer_input_kernel(dots_ptr, squares_ptr, base_ptr, scale_ptr, streams_ptr, stride_st, stride_sn, weight_ptr,
                           out_ptr, stride_out, pre_ptr, previous_pre_ptr, post_ptr, comb_ptr, T, splits, K, D,
                           norm_eps, hc_eps, eps, N: tl.constexpr, ITERS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                           BLOCK_D: tl.constexpr, NORM: tl.constexpr, ONE_PASS: tl.constexpr,
                           SINGLE_PASS: tl.constexpr):
    """``_mhc_weights_kernel`` and ``_collapse_kernel`` in one launch. V4 collapses with the ``pre`` just computed,
    which stays in registers: one program a token. V4.1 (SINGLE_PASS) collapses with ``previous_pre``, which does
    not wait for this sublayer's coefficients: two programs a token (``program_id(1)``), one computing and storing
    them, one collapsing, side by side rather than one after the other."""
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    if SINGLE_PASS and tl.program_id(1) == 1:
        _collapse_row(streams_ptr, stride_st, stride_sn, token, tl.load(previous_pre_ptr + token * N + i), weight_ptr,
                      out_ptr, stride_out, D, eps, N, BLOCK_D, NORM, ONE_PASS)
    else:
        pre, post, comb = _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, token, splits, K, norm_eps, N,
                                         SPLITS_PAD)
        rows = token + tl.arange(0, 1)
        if SINGLE_PASS:
            _store_coefficients(pre, post, comb, rows, rows < T, pre_ptr, post_ptr, comb_ptr, hc_eps, N, ITERS)
        else:
            pre, post, comb = _coefficients(pre, post, comb, hc_eps, N, ITERS)
            _store_mix(post, comb, rows, rows < T, post_ptr, comb_ptr, N)
            _collapse_row(streams_ptr, stride_st, stride_sn, token, tl.sum(pre, axis=0), weight_ptr, out_ptr,
                          stride_out, D, eps, N, BLOCK_D, NORM, ONE_PASS)


@triton.jit(do_not_specialize=["T"])  # counts of a step's rows: one binary for any
def _single_pass_input_kernel(streams_ptr, stride_st, stride_sn, flat_ptr, stride_flat, fn_ptr, dots_ptr, squares_ptr,
                              arrivals_ptr, base_ptr, scale_ptr, weight_ptr, out_ptr, stride_out, pre_ptr,
                              previous_pre_ptr, post_ptr, comb_ptr, T, K, D, norm_eps, hc_eps, eps, N: tl.constexpr,
                              M: tl.constexpr, M_PAD: tl.constexpr, ITERS: tl.constexpr, MAX_T: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                              SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                              ONE_PASS: tl.constexpr):
    """V4.1's sublayer input for a step of at most MAX_T tokens in one launch. Programs 0 to SPLITS - 1 each project
    their K split of every token's flat streams (``_token_partials``) and count themselves in on the arrival
    counter; the last to arrive sums the splits and computes every token's coefficients, then zeroes the counter.
    Program SPLITS + t collapses token t with the previous sublayer's ``pre``, which nothing in this launch writes."""
    wait_for_inputs()
    i = tl.arange(0, N)
    if tl.program_id(0) >= SPLITS:
        token = (tl.program_id(0) - SPLITS).to(tl.int64)
        _collapse_row(streams_ptr, stride_st, stride_sn, token, tl.load(previous_pre_ptr + token * N + i), weight_ptr,
                      out_ptr, stride_out, D, eps, N, BLOCK_D, NORM, ONE_PASS)
    else:
        _token_partials(flat_ptr, stride_flat, fn_ptr, dots_ptr, squares_ptr, T, K, 0, tl.program_id(0), SPLITS, M,
                        M_PAD, MAX_T, BLOCK_K, BLOCKS_PER_SPLIT)
        tl.debug_barrier()  # every thread's partials are written before the count says so (release, GPU scope)
        if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            for t in range(MAX_T):
                if t < T:
                    pre, post, comb = _summed_logits(dots_ptr, squares_ptr, base_ptr, scale_ptr, t, SPLITS, K,
                                                     norm_eps, N, SPLITS_PAD)
                    rows = t + tl.arange(0, 1)
                    _store_coefficients(pre, post, comb, rows, rows < T, pre_ptr, post_ptr, comb_ptr, hc_eps, N,
                                        ITERS)
            tl.atomic_xchg(arrivals_ptr, 0)


@triton.jit
def _expand_kernel(streams_ptr, stride_st, stride_sn, output_ptr, stride_o, post_ptr, comb_ptr, out_ptr, D,
                   N: tl.constexpr, BLOCK_D: tl.constexpr):
    """New stream o = post[o] * output + sum_i comb[i, o] * streams[i] (out is contiguous [T, N, D])."""
    wait_for_inputs()
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


@triton.jit
def _engram_gate_kernel(streams_ptr, stride_st, stride_sn, key_ptr, stride_kt, stride_kn, value_ptr, stride_v,
                        q_weight_ptr, k_weight_ptr, out_ptr, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One stream of one token (out is contiguous [T, N, D]): its three sums first, then the gated value added.
    V4.1-Flash's 5120 channels are one tile, so each pass is one round of loads."""
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    row = streams_ptr + token * stride_st + stream * stride_sn
    key_row = key_ptr + token * stride_kt + stream * stride_kn
    squares = tl.zeros([BLOCK_D], dtype=tl.float32)
    key_squares = tl.zeros([BLOCK_D], dtype=tl.float32)
    products = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in tl.static_range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        ok = offs < D
        hidden = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
        key = tl.load(key_row + offs, mask=ok, other=0.0).to(tl.float32)
        weight = (tl.load(q_weight_ptr + stream * D + offs, mask=ok, other=0.0).to(tl.float32)
                  * tl.load(k_weight_ptr + stream * D + offs, mask=ok, other=0.0).to(tl.float32))
        squares += hidden * hidden
        key_squares += key * key
        products += hidden * weight * key
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / D + eps) * tl.rsqrt(tl.sum(key_squares, axis=0) / D + eps)
    dot = tl.sum(products, axis=0) * rstd * (1.0 / tl.sqrt(D * 1.0))
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = tl.sigmoid(tl.where(dot < 0, -root, root))
    for start in tl.static_range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        ok = offs < D
        hidden = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
        value = tl.load(value_ptr + token * stride_v + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (token * tl.num_programs(1) + stream) * D + offs,
                 (hidden + gate * value).to(out_ptr.dtype.element_ty), mask=ok)


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


def _collapse_inputs(streams: torch.Tensor, norm_weight: torch.Tensor | None):
    """The streams with unit-stride channels, the norm's weight (None without) and whether there is one."""
    streams = streams if streams.stride(-1) == 1 else streams.contiguous()
    if norm_weight is None:
        return streams, None, False
    if norm_weight.dtype != torch.float32:
        raise ValueError(f"the input norm's weight must be fp32, got {norm_weight.dtype}")
    return streams, norm_weight.contiguous(), True


GEMM_TOKENS = 256  # from this many tokens on, a sublayer's projection onto fn multiplies tiles (_mix_tiles_kernel)
# Up to this many tokens V4.1's sublayer input is one launch (_single_pass_input_kernel), whose last program computes
# every token's coefficients in turn; from there one program a token computes them in a second launch. Not in
# batch-invariant mode: the two paths reduce with different warp counts. Built for 2 and tested in Triton's
# interpreter; 0 (off) until a GPU has run its tests and timed it
ONE_LAUNCH_MAX_TOKENS = 0
ONE_LAUNCH_BUILT_FOR = 2


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
                                                        ITERS=sinkhorn_iters, BLOCK_T=BLOCK_T, **LAUNCH)
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
                                                     num_warps=1, **LAUNCH)
        return pre, post, comb

    def sublayer_input(self, streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps, norm_weight=None,
                       eps=0.0):
        x, _, post, comb = self._enter(streams, None, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps,
                                       norm_weight, eps)
        return x, post, comb

    def single_pass_input(self, streams, previous_pre, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps,
                          norm_weight=None, eps=0.0):
        return self._enter(streams, previous_pre, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps,
                           norm_weight, eps)

    def _enter(self, streams, previous_pre, fn, base, scale, n, sinkhorn_iters, hc_eps, norm_eps, norm_weight, eps):
        """A sublayer's (input, pre, post, comb), collapsed with ``previous_pre`` or, without it, the fresh ``pre``
        (then never stored: None is returned for it)."""
        single_pass = previous_pre is not None
        post, comb = _mix_buffers(streams, n)
        pre = torch.empty_like(post) if single_pass else None
        one_launch = single_pass and streams.shape[0] <= ONE_LAUNCH_MAX_TOKENS and not self.batch_invariant
        if one_launch:
            flat = mix_input(streams, fn, base, scale, n, sinkhorn_iters)
        else:
            partials = _mix_partials(streams, fn, base, scale, n, sinkhorn_iters, self.gemm_tokens)
        streams, weight, norm = _collapse_inputs(streams, norm_weight)
        if single_pass:
            streams, previous_pre = _checked(streams, previous_pre)
        tokens, _, width = streams.shape
        out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
        if one_launch:
            if flat is not None:
                splits, blocks_per_split = _splits(flat.shape[1])
                dots = torch.empty(tokens, splits, (2 + n) * n, dtype=torch.float32, device=streams.device)
                squares = torch.empty(tokens, splits, dtype=torch.float32, device=streams.device)
                _single_pass_input_kernel[(splits + tokens,)](
                    streams, streams.stride(0), streams.stride(1), flat, flat.stride(0), fn, dots, squares,
                    arrival_counters(streams.device, 1), base.contiguous(), scale.contiguous(),
                    post if weight is None else weight, out, out.stride(0), pre, previous_pre, post, comb, tokens,
                    flat.shape[1], width, norm_eps, hc_eps, eps, N=n, M=(2 + n) * n,
                    M_PAD=triton.next_power_of_2((2 + n) * n), ITERS=sinkhorn_iters, MAX_T=ONE_LAUNCH_MAX_TOKENS,
                    BLOCK_K=BLOCK_K, BLOCKS_PER_SPLIT=blocks_per_split, SPLITS=splits,
                    SPLITS_PAD=triton.next_power_of_2(splits), NORM=norm, **_collapse_tiles(width), **LAUNCH)
        elif partials is not None:
            dots, squares, splits, flat_width = partials
            _sublayer_input_kernel[(tokens, 2 if single_pass else 1)](
                dots, squares, base.contiguous(), scale.contiguous(), streams, streams.stride(0), streams.stride(1),
                post if weight is None else weight, out, out.stride(0), post if pre is None else pre,
                post if previous_pre is None else previous_pre, post, comb, tokens, splits, flat_width, width,
                norm_eps, hc_eps, eps, N=n, ITERS=sinkhorn_iters, SPLITS_PAD=triton.next_power_of_2(splits),
                NORM=norm, SINGLE_PASS=single_pass, **_collapse_tiles(width), **LAUNCH)
        return out, pre, post, comb

    def collapse(self, streams, pre, norm_weight=None, eps=0.0):
        streams, pre = _checked(streams, pre)
        _, weight, norm = _collapse_inputs(streams, norm_weight)
        tokens, n, width = streams.shape
        out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
        if tokens:
            _collapse_kernel[(tokens,)](streams, streams.stride(0), streams.stride(1), pre, pre if weight is None else
                                        weight, out, out.stride(0), width, eps, N=n, NORM=norm,
                                        **_collapse_tiles(width), **LAUNCH)
        return out

    def engram_gate(self, streams, key, value, q_weight, k_weight, eps):
        tokens, n, width = streams.shape
        streams, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (streams, key, value))
        out = torch.empty(tokens, n, width, dtype=streams.dtype, device=streams.device)
        if tokens:
            _engram_gate_kernel[(tokens, n)](streams, streams.stride(0), streams.stride(1), key, key.stride(0),
                                             key.stride(1), value, value.stride(0), q_weight.contiguous(),
                                             k_weight.contiguous(), out, eps, D=width,
                                             BLOCK_D=min(ONE_PASS_MAX_WIDTH, triton.next_power_of_2(width)),
                                             num_warps=16 if width > 2048 else 4, **LAUNCH)
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
                                                                BLOCK_D=block, **LAUNCH)
        return out
