"""Sparse MQA attention with sinks and the lightning indexer's scores in Triton.

All heads of a token read the same keys (MQA, K = V), so one program takes a block of heads and gathers each key row
through the index list once for all of them: the scores are one ``tl.dot(q_heads, keys^T)`` and the values
``p @ keys``, with an fp32 online softmax in between. A program handles up to two sources (the sliding window and the
compressed entries) in one pass; more sources are served two per launch and merged like key splits. At decode
there are too few (token, head block) programs to fill the GPU, so each token's keys are also split across programs
(flash-decoding): every split writes its unnormalized sum with its running max and denominator, and one more kernel
merges them and adds the sink (``_merge_kernel``; a dozen torch ops otherwise, per layer and step). With a single split the kernel adds the sink itself and writes the output.
Head blocks are at least 16 rows (tl.dot's minimum; missing heads are masked), and on the GPU the probabilities are
rounded to the pool's dtype for the second dot, the usual flash-attention trade (the interpreter stays in fp32).

Index lists are read on the GPU, shapes fix the grid, and nothing waits on the host, so both entry points can be
captured in a CUDA graph. Index -1 masks a key; a row with no key keeps the initial finite max, so only the sink is
left in its denominator and its output is 0, as in the reference.

The indexer scores ``sum_h w[t,h] * relu(q[t,h] . key)`` with the same gather-and-dot per tile of candidates; the
top-k selection is the reference's own (a stable sort), so ties break the same way.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from deepinfer.runtime import fp8_kv
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.kv_store import NOPE as FP8_NOPE
from deepinfer_nvidia.kv_store import PAGE as FP8_PAGE
from deepinfer_nvidia.kv_store import PAGE_BYTES as FP8_PAGE_BYTES
from deepinfer_nvidia.kv_store import ROW_BYTES as FP8_ROW_BYTES
from deepinfer_nvidia.kv_store import SCALE_BYTES as FP8_SCALE_BYTES
from deepinfer_nvidia.kv_store import TILE as FP8_TILE

LOG2E = math.log2(math.e)
MAX_CANDIDATE_TILES = 8  # indexer tiles per program (a power of two: at most 4 builds) amortize its q load


@triton.jit
def _fp8_keys(pool_ptr, bytes_ptr, idx, valid, offs_d):
    """Rows ``idx`` of an FP8 pool (``deepinfer.runtime.fp8_kv``) as fp32: e4m3 NoPE channels times their tile's
    power of two, then the bf16 RoPE channels (read as byte pairs and widened exactly)."""
    row = tl.where(valid, idx, 0).to(tl.int64)
    base = (row // FP8_PAGE) * FP8_PAGE_BYTES
    data = base + (row % FP8_PAGE) * FP8_ROW_BYTES
    scales = base + FP8_PAGE * FP8_ROW_BYTES + (row % FP8_PAGE) * FP8_SCALE_BYTES
    nope = offs_d < FP8_NOPE
    nope_ok = valid[:, None] & nope[None, :]
    rope_ok = valid[:, None] & (offs_d >= FP8_NOPE)[None, :]
    values = tl.load(pool_ptr + data[:, None] + offs_d[None, :], mask=nope_ok, other=0.0).to(tl.float32)
    exponent = tl.load(bytes_ptr + scales[:, None] + offs_d[None, :] // FP8_TILE, mask=nope_ok, other=127)
    rope_at = data[:, None] + FP8_NOPE + 2 * (offs_d[None, :] - FP8_NOPE)
    low = tl.load(bytes_ptr + rope_at, mask=rope_ok, other=0).to(tl.int32)
    high = tl.load(bytes_ptr + rope_at + 1, mask=rope_ok, other=0).to(tl.int32)
    rope = ((high << 24) | (low << 16)).to(tl.float32, bitcast=True)  # bf16 bits are fp32's upper half
    return tl.where(nope[None, :], values * tl.exp2(exponent.to(tl.float32) - 127), rope)


@triton.jit
def _attend_tile(q, m, l, acc, pool_ptr, bytes_ptr, stride_pool, idx_ptr, stride_ik, count, first, offs_n, offs_d,
                 qk_scale, NATIVE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step over keys ``first ..`` of one source's index list (scores in log2 units)."""
    j = first + offs_n
    idx = tl.load(idx_ptr + j * stride_ik, mask=j < count, other=-1)
    valid = idx >= 0
    if FP8:
        keys = _fp8_keys(pool_ptr, bytes_ptr, idx, valid, offs_d)
        if NATIVE:
            keys = keys.to(tl.bfloat16)
    else:
        keys = tl.load(pool_ptr + idx[:, None] * stride_pool + offs_d[None, :], mask=valid[:, None], other=0.0)
        if not NATIVE:  # Triton's interpreter has no bf16 arithmetic
            keys = keys.to(tl.float32)
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _attend(q, m, l, acc, pool_ptr, bytes_ptr, stride_pool, idx_ptr, stride_ik, count, tiles, split, offs_n, offs_d,
            qk_scale, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    """This split's ``tiles`` tiles of one source."""
    if NATIVE:
        for i in range(tiles):
            m, l, acc = _attend_tile(q, m, l, acc, pool_ptr, bytes_ptr, stride_pool, idx_ptr, stride_ik, count,
                                     (split * tiles + i) * BLOCK_N, offs_n, offs_d, qk_scale, NATIVE, PRECISION, FP8)
    else:  # under numpy 2 the interpreter's range() rejects a bound that is not a constexpr; while works
        i = 0
        while i < tiles:
            m, l, acc = _attend_tile(q, m, l, acc, pool_ptr, bytes_ptr, stride_pool, idx_ptr, stride_ik, count,
                                     (split * tiles + i) * BLOCK_N, offs_n, offs_d, qk_scale, NATIVE, PRECISION, FP8)
            i += 1
    return m, l, acc


@triton.jit
def _attention_kernel(q_ptr, stride_qt, stride_qh, a_ptr, a_bytes_ptr, stride_a, ia_ptr, stride_iat, stride_iak, count_a,
                      tiles_a, b_ptr, b_bytes_ptr, stride_b, ib_ptr, stride_ibt, stride_ibk, count_b, tiles_b, sink_ptr,
                      out_ptr, stride_ot, stride_oh, part_ptr, stat_ptr, H, splits_total, split_base, qk_scale,
                      D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_B: tl.constexpr,
                      FINAL: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)  # token * stride overflows int32 in long prefills
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = offs_h < H
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None],
                other=0.0)
    if FP8:  # keys are widened to bf16 for the dots
        q = q.to(tl.bfloat16) if NATIVE else q.to(tl.float32)
    else:
        q = q.to(a_ptr.dtype.element_ty) if NATIVE else q.to(tl.float32)
    # finite start: a row with no valid key then gets exp2(-inf - m) = 0, never -inf - -inf = NaN
    m = tl.full((BLOCK_H,), -1.0e30, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m, l, acc = _attend(q, m, l, acc, a_ptr, a_bytes_ptr, stride_a, ia_ptr + token * stride_iat, stride_iak, count_a,
                        tiles_a, split, offs_n, offs_d, qk_scale, BLOCK_N, NATIVE, PRECISION, FP8)
    if HAS_B:
        m, l, acc = _attend(q, m, l, acc, b_ptr, b_bytes_ptr, stride_b, ib_ptr + token * stride_ibt, stride_ibk,
                            count_b, tiles_b, split, offs_n, offs_d, qk_scale, BLOCK_N, NATIVE, PRECISION, FP8)
    if FINAL:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        top = tl.maximum(m, sink)
        kept = tl.exp2(m - top)
        out = acc * (kept / (l * kept + tl.exp2(sink - top)))[:, None]
        tl.store(out_ptr + token * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        row = (token * H + offs_h) * splits_total + split_base + split  # part [T, H, S, D], stat [2, T, H, S]
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=h_ok[:, None])
        tl.store(stat_ptr + row, m, mask=h_ok)
        tl.store(stat_ptr + tl.num_programs(0) * H * splits_total + row, l, mask=h_ok)


@triton.jit
def _merge_kernel(part_ptr, stat_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh, num_heads, total, sink_scale,
                  D: tl.constexpr, SPLITS: tl.constexpr):
    """One (token, head): ``sum_s 2^(m_s - top) acc_s / (sum_s 2^(m_s - top) l_s + 2^(sink - top))``, where
    ``top`` is the largest of the splits' maxima and the sink (all in log2 units); ``part`` is [T, H, total, D] and
    ``stat`` [2, T, H, total], both fp32 and contiguous."""
    wait_for_inputs()
    token, head = tl.program_id(0), tl.program_id(1)
    row = token * num_heads + head
    offs_s = tl.arange(0, SPLITS)
    m = tl.load(stat_ptr + row * total + offs_s, mask=offs_s < total, other=float("-inf"))
    sink = tl.load(sinks_ptr + head).to(tl.float32) * sink_scale
    top = tl.maximum(tl.max(m, axis=0), sink)
    # both sums in split order, one split at a time: splits past a row's keys then add exact zeros, so the result
    # does not depend on how many splits the call has (batch-invariant mode fixes the split size)
    denominator = tl.exp2(sink - top)
    offs_d = tl.arange(0, D)
    acc = tl.zeros((D,), dtype=tl.float32)
    s = 0
    while s < total:  # a while loop: the interpreter's range() wants a constexpr bound (see _attend)
        weight = tl.exp2(tl.load(stat_ptr + row * total + s) - top)
        denominator += weight * tl.load(stat_ptr + (tl.num_programs(0) * num_heads + row) * total + s)
        acc += weight * tl.load(part_ptr + (row * total + s) * D + offs_d)
        s += 1
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, (acc / denominator).to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_normalized_kernel(a_ptr, stride_at, stride_ah, lse_a_ptr, stride_lat, b_ptr, stride_bt, stride_bh, lse_b_ptr,
                             stride_lbt, sinks_ptr, out_ptr, stride_ot, stride_oh, D: tl.constexpr):
    """One (token, head) from two sources' attention outputs, each normalized over its own keys, and their
    natural-log sums: ``(e^lse_a o_a + e^lse_b o_b) / (e^lse_a + e^lse_b + e^sink)`` in fp32; a source without keys
    (lse +inf) weighs 0."""
    wait_for_inputs()
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_d = tl.arange(0, D)
    lse_a = tl.load(lse_a_ptr + token * stride_lat + head)
    lse_a = tl.where(lse_a == float("inf"), float("-inf"), lse_a)
    lse_b = tl.load(lse_b_ptr + token * stride_lbt + head)
    lse_b = tl.where(lse_b == float("inf"), float("-inf"), lse_b)
    sink = tl.load(sinks_ptr + head).to(tl.float32)
    top = tl.maximum(tl.maximum(lse_a, lse_b), sink)
    weight_a, weight_b = tl.exp(lse_a - top), tl.exp(lse_b - top)
    acc = weight_a * tl.load(a_ptr + token * stride_at + head * stride_ah + offs_d).to(tl.float32)
    acc += weight_b * tl.load(b_ptr + token * stride_bt + head * stride_bh + offs_d).to(tl.float32)
    out = acc / (weight_a + weight_b + tl.exp(sink - top))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _indexer_kernel(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, k_ptr, stride_k, c_ptr, stride_ct, stride_cc,
                    out_ptr, stride_ot, H, C, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                    TILES: tl.constexpr, NATIVE: tl.constexpr, PRECISION: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    q = tl.load(q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_ok[:, None],
                other=0.0)
    q = q.to(k_ptr.dtype.element_ty) if NATIVE else q.to(tl.float32)
    w = tl.load(w_ptr + token * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    for i in range(TILES):
        offs_c = (tl.program_id(1) * TILES + i) * BLOCK_C + tl.arange(0, BLOCK_C)
        cand = tl.load(c_ptr + token * stride_ct + offs_c * stride_cc, mask=offs_c < C, other=-1)
        keys = tl.load(k_ptr + cand[:, None] * stride_k + offs_d[None, :], mask=(cand >= 0)[:, None], other=0.0)
        if not NATIVE:
            keys = keys.to(tl.float32)
        dots = tl.dot(q, tl.trans(keys), input_precision=PRECISION)  # [heads, candidates]
        scores = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        tl.store(out_ptr + token * stride_ot + offs_c, tl.where(cand >= 0, scores, float("-inf")), mask=offs_c < C)


def _check_dim(dim: int, what: str) -> None:
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"{what} must be a power of two >= 16 for the Triton kernels (tl.dot tiles), got {dim}")


@functools.cache  # the answer never changes, and asking is a host call we keep out of the step
def _parallelism(device: torch.device) -> int:
    """Programs that fill the device about once; the interpreter gets a few so small tests still split."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    # the kernels step through a row's elements one by one (pools and caches always are laid out so)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_options(dtype: torch.dtype, device: torch.device) -> dict:
    # fp32 pools are for tests and debugging: full-precision dots there rather than tf32
    return {"NATIVE": device.type == "cuda", "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _pool_args(pool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values pointer, bytes pointer, row stride) of a pool as the kernel reads it."""
    if isinstance(pool, fp8_kv.FP8Rows):
        return pool.data.view(torch.float8_e4m3fn), pool.data, 0
    pool = _unit_rows(pool)
    return pool, pool, pool.stride(0)


def decode_splits(programs: int, tiles: int, sms: int) -> int:
    """Flash-decoding splits of ``tiles`` key tiles for a launch of ``programs`` (token, head block, source group)
    programs on ``sms`` SMs.

    A launch of up to a quarter of the SMs gets as many splits as fill them once, down to one tile a split. Measured
    on an H200 (V4.1-Flash's 64 heads of 512, window + 512 compressed entries, ``tools/gpu/gpu_kernels.py
    --attention-splits``): at 16 tokens 4 splits (128 programs) take 32.4 µs and 5 (160, a second wave) 50.0; at one
    token 20 one-tile splits 22.0 µs and 5 of 4 tiles 29.5. A one-tile split's fp32 partial (64 KiB) outweighs its
    keys (32 KiB), but a launch this short of programs is bound by its slowest program's serial tiles. Larger
    launches keep the rule they were measured with: splits rounded up to fill the SMs, 4+ tiles each."""
    if programs * 4 <= sms:
        return max(1, min(sms // programs, tiles))
    return max(1, min(triton.cdiv(sms, programs), tiles // 4))


def sparse_attention(q, sources, sinks, scale, block_h: int | None = None, splits: int | None = None,
                     tiles_per_split: int | None = None):
    """The protocol's ``sparse_attention``; ``block_h`` and ``splits`` override the tiling (tests use them). Pools
    are row tensors or FP8 rows (``deepinfer.runtime.fp8_kv``), not both in one call.

    With ``tiles_per_split`` every split covers that many key tiles of each source, whatever the batch, and the
    splits are always merged: a query's reduction order then depends only on its own index list (batch-invariant
    mode). Otherwise the split count fills the device and a single split normalizes in the attention kernel."""
    num_tokens, num_heads, dim = q.shape
    _check_dim(dim, "the attention head dim")
    q = _unit_rows(q)
    if len({pool.dtype for pool, _ in sources}) != 1:
        raise ValueError("all key pools of one attention call must share a dtype")
    fp8 = {isinstance(pool, fp8_kv.FP8Rows) for pool, _ in sources}
    if len(fp8) != 1:
        raise ValueError("an attention call reads FP8 pools or row tensors, not both")
    fp8 = fp8.pop()
    if fp8 and dim != fp8_kv.WIDTH:
        raise ValueError(f"FP8 pools hold {fp8_kv.WIDTH}-wide rows; the queries are {dim} wide")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # tiles sized by a row's bytes: bf16 rows of 512 get 32 heads (a 64 KiB fp32 accumulator) and 32-key tiles;
    # fp32 pools (tests, debugging) halve both to stay within shared memory
    row_bytes = dim * (2 if fp8 else sources[0][0].element_size())  # FP8 rows are widened to bf16 tiles
    widest = 64 if row_bytes <= 512 else 32 if row_bytes <= 1024 else 16
    block_h = block_h or min(max(16, triton.next_power_of_2(num_heads)), widest)
    block_n = max(16, min(64, 32768 // row_bytes))
    head_blocks = triton.cdiv(num_heads, block_h)
    groups = [sources[i:i + 2] for i in range(0, len(sources), 2)]
    tiles = [sum(triton.cdiv(idx.shape[1], block_n) for _, idx in group) for group in groups]
    if tiles_per_split is not None:
        splits = max(1, *(triton.cdiv(triton.cdiv(idx.shape[1], block_n), tiles_per_split) for _, idx in sources))
    elif splits is None:
        splits = decode_splits(num_tokens * head_blocks * len(groups), max(tiles), _parallelism(q.device))
    total = splits * len(groups)
    final = total == 1 and tiles_per_split is None
    part = stat = out  # unused placeholders when the kernel writes the output itself
    if not final:
        part = torch.empty(num_tokens, num_heads, total, dim, dtype=torch.float32, device=q.device)
        stat = torch.empty(2, num_tokens, num_heads, total, dtype=torch.float32, device=q.device)
    options = _launch_options(sources[0][0].dtype, q.device)
    for g, group in enumerate(groups):
        (a, ia), (b, ib) = group[0], group[-1]  # a lone source passes itself twice, and HAS_B drops the copy
        tiles_a, tiles_b = (tiles_per_split or triton.cdiv(triton.cdiv(idx.shape[1], block_n), splits)
                            for idx in (ia, ib))
        _attention_kernel[(num_tokens, head_blocks, splits)](
            q, q.stride(0), q.stride(1), *_pool_args(a), ia, ia.stride(0), ia.stride(1), ia.shape[1], tiles_a,
            *_pool_args(b), ib, ib.stride(0), ib.stride(1), ib.shape[1], tiles_b,
            sinks, out, out.stride(0), out.stride(1), part, stat, num_heads, total, g * splits, scale * LOG2E,
            D=dim, BLOCK_H=block_h, BLOCK_N=block_n, HAS_B=len(group) == 2, FINAL=final, FP8=fp8,
            num_warps=8 if row_bytes >= 512 else 4, num_stages=2, **options, **LAUNCH)
    if not final:  # each split carries sum(2^(s - m) v), its max m and denominator l (log2 units)
        _merge_kernel[(num_tokens, num_heads)](part, stat, sinks, out, out.stride(0), out.stride(1), num_heads, total,
                                               LOG2E, D=dim, SPLITS=triton.next_power_of_2(total), **LAUNCH)
    return out


def indexer_scores(q, weights, keys, candidates):
    num_tokens, num_heads, dim = q.shape
    _check_dim(dim, "the indexer head dim")
    q, keys = _unit_rows(q), _unit_rows(keys)
    width = candidates.shape[1]
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_c = 64
    candidate_tiles = triton.cdiv(width, block_c)
    # as many tiles per program as still leaves about two programs per SM, no more than there are, and a power of two:
    # TILES is a constant of the binary, so each value a step's size picks is a build (1, 2, 4, 8: four at most)
    tiles = max(1, min(MAX_CANDIDATE_TILES, triton.next_power_of_2(candidate_tiles),
                       num_tokens * candidate_tiles // (2 * _parallelism(q.device))))
    tiles = 1 << (tiles.bit_length() - 1)
    grid = (num_tokens, triton.cdiv(candidate_tiles, tiles))
    _indexer_kernel[grid](q, q.stride(0), q.stride(1), weights, weights.stride(0), keys, keys.stride(0), candidates,
                          candidates.stride(0), candidates.stride(1), out, out.stride(0), num_heads, width, D=dim,
                          BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_C=block_c, TILES=tiles,
                          **_launch_options(keys.dtype, q.device), **LAUNCH)
    return out
