"""V4's compressor in two launches per call. Pooling (``AttentionBackend.compress_pool``): one program per closing
window gathers its state rows, takes the per-channel softmax over their scores with an online max, sums the weighted
kv and RMS-normalizes the result. The torch reference (``deepinfer.runtime.ops.compress_pool``) spends about a dozen
kernels per call, and a V4-Flash decode step makes 62 calls (every compressed layer, and the indexer's too). The
state rows (``store_compressor_rows``): widened, position-biased and written in one pass instead of seven kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

ROWS_BLOCK = 1024


@triton.jit
def _compress_pool_kernel(state_ptr, stride_state, rows_ptr, stride_rows, weight_ptr, out_ptr, stride_out, eps,
                          RATIO: tl.constexpr, OVERLAP: tl.constexpr, D: tl.constexpr):
    wait_for_inputs()
    window = tl.program_id(0).to(tl.int64)
    # padded decode steps list a row for every token; where no window closes every slot is -1 and the result goes
    # to a scratch row nobody reads: skip the 2 x RATIO x OVERLAP row loads (a ratio-128 layer's are most of it)
    if tl.load(rows_ptr + window * stride_rows + OVERLAP * RATIO - 1) < 0:
        return
    offs = tl.arange(0, D)
    m = tl.full((D,), float("-inf"), tl.float32)
    l = tl.zeros((D,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for j in tl.static_range(OVERLAP * RATIO):
        slot = tl.load(rows_ptr + window * stride_rows + j)
        # with two overlapping series, the older window's rows give their first D channels, this one's the second
        column = (j // RATIO) * D if OVERLAP == 2 else 0
        ok = (slot + tl.zeros((D,), tl.int64)) >= 0  # a vector mask: interpreters reject a scalar's broadcast
        row = state_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_state + column
        kv = tl.load(row + offs, mask=ok, other=0.0)
        score = tl.load(row + OVERLAP * D + offs, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, score)
        # a channel that has seen no row yet keeps m = -inf: no exp(-inf - -inf) is ever taken
        seen = m_new > float("-inf")
        scale = tl.where(seen, tl.exp(tl.where(seen, m, 0.0) - tl.where(seen, m_new, 0.0)), 0.0)
        p = tl.where(ok, tl.exp(tl.where(ok, score, 0.0) - tl.where(ok, m_new, 0.0)), 0.0)
        l = l * scale + p
        acc = acc * scale + p * kv
        m = m_new
    pooled = acc / l
    rstd = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / D + eps)
    out = pooled * rstd * tl.load(weight_ptr + offs)
    tl.store(out_ptr + window * stride_out + offs, out)


def compress_pool(state, rows, ratio, overlap, norm_weight, eps):
    """``AttentionBackend.compress_pool``: [n, D] fp32."""
    dim = norm_weight.shape[0]
    if state.dtype != torch.float32 or state.shape[1] != 2 * overlap * dim or state.stride(1) != 1:
        raise ValueError(f"compressor state must be fp32 [rows, {2 * overlap * dim}] with unit column stride, got "
                         f"{state.dtype} {list(state.shape)}")
    out = torch.empty(rows.shape[0], dim, dtype=torch.float32, device=state.device)
    if rows.shape[0]:
        rows = rows.contiguous()
        _compress_pool_kernel[(rows.shape[0],)](state, state.stride(0), rows, rows.stride(0),
                                                norm_weight.float().contiguous(), out, out.stride(0), eps,
                                                RATIO=ratio, OVERLAP=overlap, D=dim, **LAUNCH)
    return out


@triton.jit
def _compressor_rows_kernel(kv_ptr, stride_kv, score_ptr, stride_score, bias_ptr, positions_ptr, slots_ptr,
                            state_ptr, stride_state, C, R, BLOCK_C: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    phase = tl.load(positions_ptr + token) % R
    kv = tl.load(kv_ptr + token * stride_kv + offs, mask=ok, other=0.0).to(tl.float32)
    score = tl.load(score_ptr + token * stride_score + offs, mask=ok, other=0.0).to(tl.float32)
    score += tl.load(bias_ptr + phase * C + offs, mask=ok, other=0.0)
    row = state_ptr + tl.load(slots_ptr + token) * stride_state
    tl.store(row + offs, kv, mask=ok)
    tl.store(row + C + offs, score, mask=ok)


def store_compressor_rows(state, slots, kv, score, position_bias, positions):
    """``AttentionBackend.store_compressor_rows``."""
    tokens, width = kv.shape
    if score.shape != kv.shape or position_bias.shape[1] != width or state.shape[1] != 2 * width:
        raise ValueError(f"compressor rows: kv {list(kv.shape)}, score {list(score.shape)}, position bias "
                         f"{list(position_bias.shape)} and state {list(state.shape)} do not fit together")
    if state.dtype != torch.float32 or position_bias.dtype != torch.float32 or state.stride(1) != 1:
        raise ValueError(f"compressor state and position bias must be fp32 (state with unit column stride), got "
                         f"{state.dtype} and {position_bias.dtype}")
    if tokens:
        # a fused projection's column slices: rows keep their stride, columns must be dense
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        score = score if score.stride(-1) == 1 else score.contiguous()
        bias = position_bias.contiguous()
        grid = (tokens, triton.cdiv(width, ROWS_BLOCK))
        _compressor_rows_kernel[grid](kv, kv.stride(0), score, score.stride(0), bias, positions.contiguous(),
                                      slots.contiguous(), state, state.stride(0), width, bias.shape[0],
                                      BLOCK_C=ROWS_BLOCK, **LAUNCH)
