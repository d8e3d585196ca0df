"""The routed experts' block table in one launch, and their weighted top-k sum in another.

``sorted_blocks`` builds it from torch ops (a sort, two searchsorted, a cumsum and a dozen small element-wise ops and
casts): about twenty kernels per MoE layer, each a node of the decode graph that the host launches and the device
runs for a few microseconds. Here one launch does it for the decode-sized case (few assignments): each program
counts every expert's assignments, ranks a chunk of assignments stably (how many come before it in (expert, index)
order: the order ``torch.sort(stable=True)`` gives), and fills a chunk of blocks exactly as ``sorted_blocks`` does,
surplus blocks included. Its work grows with assignments squared, so long prefills keep the torch ops (they are not
in a graph, and a sort is the better algorithm there). One program doing every chunk in turn, as first written,
took 161 µs a layer for a 64-token step of V4.1-Flash (384 assignments, 408 blocks) on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

MAX_ASSIGNMENTS = 1024  # tokens x top-k up to which this launch wins over the sort (decode batches)
MAX_CHUNK = 64


@triton.jit
def e8m0_to_fp32(exponent):
    """fp32 powers of two from e8m0 exponents (int32, 0-255) by moving bits: the byte is fp32's exponent field, and
    exponent 0 (2^-127) fp32's subnormal bit 22, which the max gives. Integer ops, where exp2 would take the
    special-function unit."""
    return tl.maximum(exponent << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _pick(select, values):
    """``values[index]`` for each row of the one-hot ``select`` [n, E]: registers cannot be indexed."""
    return tl.sum(tl.where(select, values[None, :], 0), axis=1)


@triton.jit(do_not_specialize=["assignments", "num_blocks"])  # counts of a step's rows: one binary for any
def _blocks_kernel(ids_ptr, assignments, experts, num_blocks, order_ptr, token_of_ptr, sorted_rows_ptr, expert_ptr,
                   start_ptr, rows_ptr, TOP_K: tl.constexpr, BM: tl.constexpr, E_PAD: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Program p ranks assignments [p * CHUNK, (p + 1) * CHUNK) and fills blocks [p * CHUNK, (p + 1) * CHUNK):
    the programs share nothing, each counting the experts' assignments itself (one pass over the ids)."""
    wait_for_inputs()
    e = tl.arange(0, E_PAD)
    lane = tl.arange(0, CHUNK)
    mine = tl.program_id(0) * CHUNK + lane
    # an assignment's rank is how many come before it in (expert, index) order: torch.sort(stable=True)'s place
    i_ok = mine < assignments
    ids = tl.load(ids_ptr + mine, mask=i_ok, other=-1)
    rank = tl.zeros((CHUNK,), tl.int32)
    counts = tl.zeros((E_PAD,), tl.int32)
    c = 0
    while c < assignments:  # while loops: the interpreter's range() wants constexpr bounds
        j = c + lane
        other = tl.load(ids_ptr + j, mask=j < assignments, other=E_PAD)  # past the end: after every expert
        before = (other[None, :] < ids[:, None]) | ((other[None, :] == ids[:, None]) & (j[None, :] < mine[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
        counts += tl.sum((other[:, None] == e[None, :]).to(tl.int32), axis=0)
        c += CHUNK
    tl.store(order_ptr + rank, mine, mask=i_ok)
    tl.store(token_of_ptr + rank, mine // TOP_K, mask=i_ok)
    tl.store(sorted_rows_ptr + mine, mine, mask=i_ok)
    first_row = tl.cumsum(counts, 0) - counts
    per_expert = (counts + BM - 1) // BM
    block_end = tl.cumsum(per_expert, 0)
    b = mine
    # the expert whose blocks cover b (searchsorted right); past the last block, the last expert
    expert = tl.minimum(tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1), experts - 1)
    select = expert[:, None] == e[None, :]
    index_in_expert = b - (_pick(select, block_end) - _pick(select, per_expert))
    b_ok = b < num_blocks
    tl.store(expert_ptr + b, expert, mask=b_ok)
    tl.store(start_ptr + b, _pick(select, first_row) + index_in_expert * BM, mask=b_ok)
    rows = tl.minimum(tl.maximum(_pick(select, counts) - index_in_expert * BM, 0), BM)
    tl.store(rows_ptr + b, rows, mask=b_ok)


def expert_sorted(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, order, first_row)``: the flattened assignments' experts sorted stably, the permutation that
    sorts them, and each expert's first sorted row plus the total ([experts + 1]); device ops only."""
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    first_row = torch.searchsorted(sorted_ids, torch.arange(experts + 1, device=topk_ids.device))
    return sorted_ids, order, first_row


def rows_from(sorted_ids: torch.Tensor, order: torch.Tensor, first_row: torch.Tensor,
              expert_start: torch.Tensor) -> torch.Tensor:
    """Each assignment's row (in ``topk_ids.flatten()`` order, ``expert_sorted``'s outputs) in a layout where expert
    ``e``'s rows start at ``expert_start[e]``, in the sorted order; device ops only."""
    rank_in_expert = torch.arange(order.numel(), device=order.device) - first_row[sorted_ids]
    rows = torch.empty_like(order)
    rows[order] = expert_start[sorted_ids] + rank_in_expert
    return rows


def sorted_blocks(topk_ids: torch.Tensor, experts: int, bm: int):
    """Expert-sorted assignment order and, per block of a grid sized from shapes alone, its expert, first sorted row
    and row count (0 for surplus blocks). Only device-side ops: no bincount or repeat_interleave, which sync."""
    device = topk_ids.device
    sorted_ids, order, first_row = expert_sorted(topk_ids, experts)
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


def assignment_blocks(topk_ids: torch.Tensor, experts: int, bm: int):
    """``(order, token_of, sorted_rows, (expert, start, rows))``, int32: the expert-sorted assignments (flat
    (token, slot) ids), each one's token, the identity row map, and the blocks of ``bm`` rows. Decode-sized calls
    take the one launch (``expert_blocks``), long prefills the sort (``sorted_blocks``)."""
    if serves(topk_ids.numel()):  # decode: one launch instead of ~20 small ones
        return expert_blocks(topk_ids, experts, bm)
    order, blocks = sorted_blocks(topk_ids, experts, bm)
    sorted_rows = torch.arange(len(order), dtype=torch.int32, device=topk_ids.device)
    return order.int(), (order // topk_ids.shape[1]).int(), sorted_rows, blocks


def serves(assignments: int) -> bool:
    return assignments <= MAX_ASSIGNMENTS


def expert_blocks(topk_ids: torch.Tensor, experts: int, bm: int):
    """``(order, token_of, sorted_rows, (expert, start, rows))``, all int32: ``sorted_blocks``'s order and blocks,
    each assignment's token and the identity row map, in one launch."""
    assignments = topk_ids.numel()
    num_blocks = triton.cdiv(assignments, bm) + min(experts, assignments)
    device = topk_ids.device
    order, token_of, sorted_rows = (torch.empty(assignments, dtype=torch.int32, device=device) for _ in range(3))
    expert, start, rows = (torch.empty(num_blocks, dtype=torch.int32, device=device) for _ in range(3))
    # every op works on [chunk, experts] tiles: a batch-1 step (6 assignments, 7 blocks) needs 16 rows, not 64; a
    # program's time is its ops' length, so each gets every warp an SM can give it
    chunk = min(MAX_CHUNK, max(16, triton.next_power_of_2(max(assignments, num_blocks))))
    programs = triton.cdiv(max(assignments, num_blocks), chunk)
    _blocks_kernel[(programs,)](topk_ids.contiguous(), assignments, experts, num_blocks, order, token_of, sorted_rows,
                                expert, start, rows, TOP_K=topk_ids.shape[1], BM=bm,
                                E_PAD=triton.next_power_of_2(experts), CHUNK=chunk, num_warps=16, **LAUNCH)
    return order, token_of, sorted_rows, (expert, start, rows)


@triton.jit
def swiglu(gate, up, limit):
    """deepinfer.runtime.ops.swiglu, in fp32."""
    gate = tl.minimum(gate, limit)
    return gate * tl.sigmoid(gate) * tl.clamp(up, -limit, limit)


@triton.jit
def store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                SWIGLU: tl.constexpr):
    """Writes the tile (or swiglu of it and ``up``) to the output rows that ``out_rows`` names for its rows."""
    if SWIGLU:
        acc = swiglu(acc, up, limit)
    rows = tl.load(out_rows_ptr + start + offs_m, mask=m_ok, other=0)
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def column_tile(n: int) -> int:
    """Columns per program of the expert kernels that take one tile width (64, or 32 for narrower outputs)."""
    return 64 if n >= 64 else 32


@triton.jit
def block_tile(count, block_expert_ptr, block_start_ptr, a_rows_ptr, N, BLOCK_M: tl.constexpr, BN: tl.constexpr):
    """This program's expert, first sorted row, row and column offsets with their masks, and the rows of ``a``
    its assignments read."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)  # times its stride: past 2^31 in a large layer
    start = tl.load(block_start_ptr + block)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(a_rows_ptr + start + offs_m, mask=m_ok, other=0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    return expert, start, offs_m, m_ok, rows, offs_n, offs_n < N


@triton.jit
def _combine_kernel(down_ptr, weights_ptr, out_ptr, D, stride_down, stride_w, stride_out, TOP_K: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for k in tl.static_range(TOP_K):  # in slot order, as the reference's sum over the top-k axis
        weight = tl.load(weights_ptr + token * stride_w + k).to(tl.float32)
        acc += weight * tl.load(down_ptr + (token * TOP_K + k) * stride_down + offs, mask=ok, other=0.0)
    tl.store(out_ptr + token * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine(down: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(down.view(T, k, D) * topk_weights[..., None]).sum(1).to(dtype)`` in one launch (``down`` fp32 [T*k, D])."""
    tokens, top_k = topk_weights.shape
    width = down.shape[1]
    topk_weights = topk_weights if topk_weights.stride(-1) == 1 else topk_weights.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    out = torch.empty(tokens, width, dtype=dtype, device=down.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(width))
        _combine_kernel[(tokens, triton.cdiv(width, block))](down, topk_weights, out, width, down.stride(0),
                                                             topk_weights.stride(0), out.stride(0), TOP_K=top_k,
                                                             BLOCK_D=block, **LAUNCH)
    return out
