"""A padded decode step's cache slots in one launch per cache kind group (``deepinfer.runtime.slots.padded_slots`` is
the reference).

Replayed from a CUDA graph, the reference's integer arithmetic is ~25 kernels per compression ratio plus ~10 for
the sliding window, each a microsecond or two of device time and a graph node the host launches: about a hundred
per step for V4-Flash's layer pattern. Here one program per token (and candidate chunk) computes the same slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime.slots import PaddedSlots, SlotLayout
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

BLOCK_CANDIDATES = 256


@triton.jit
def _slot(table_row, blocks, pos, rows, span, BLOCK_SIZE: tl.constexpr):
    """Row slot of ``pos`` for the table row at ``table_row``: -1 where ``pos`` < 0 or its block is absent.
    ``span`` = positions per row (``BLOCK_SIZE // rows``)."""
    column = tl.minimum(tl.maximum(pos // BLOCK_SIZE, 0), blocks - 1)
    block = tl.load(table_row + column)
    within = (pos % BLOCK_SIZE) // span
    return tl.where((pos >= 0) & (block >= 0), block * rows + within, -1)


@triton.jit
def _window_kernel(positions_ptr, owner_ptr, table_ptr, stride_table, blocks, rows, span, scratch, window_ptr,
                   written_ptr, W, BLOCK_SIZE: tl.constexpr, W_PAD: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    table_row = table_ptr + tl.load(owner_ptr + token) * stride_table
    j = tl.arange(0, W_PAD)
    slots = _slot(table_row, blocks, position - W + 1 + j, rows, span, BLOCK_SIZE)
    tl.store(window_ptr + token.to(tl.int64) * W + j, slots, mask=j < W)
    own = _slot(table_row, blocks, position, rows, span, BLOCK_SIZE)  # the window's last column
    tl.store(written_ptr + token, tl.where(own < 0, scratch, own))


@triton.jit
def _compressed_kernel(positions_ptr, owner_ptr, comp_ptr, stride_comp, comp_blocks, comp_rows, comp_span,
                       comp_scratch, state_ptr, stride_state, state_blocks, state_rows, state_span, state_scratch,
                       candidates_ptr, C, close_rows_ptr, state_slots_ptr, close_slots_ptr, close_positions_ptr,
                       RATIO: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_C: tl.constexpr, STATE_PAD: tl.constexpr):
    """Program (token, chunk): that chunk of the token's candidates; chunk 0 also the token's state row, its
    close row (pooled rows, new entry's slot and position: -1 / scratch where its window does not close)."""
    wait_for_inputs()
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    position = tl.load(positions_ptr + token)
    owner = tl.load(owner_ptr + token)
    comp_row = comp_ptr + owner * stride_comp
    visible = (position + 1) // RATIO
    entries = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    entry_pos = tl.where(entries < visible, entries * RATIO, -1)
    candidates = _slot(comp_row, comp_blocks, entry_pos, comp_rows, comp_span, BLOCK_SIZE)
    tl.store(candidates_ptr + token.to(tl.int64) * C + entries, candidates, mask=entries < C)
    if chunk == 0:
        window_id = tl.where((position + 1) % RATIO == 0, visible - 1, -1)
        new_entry = _slot(comp_row, comp_blocks, window_id * RATIO, comp_rows, comp_span, BLOCK_SIZE)
        tl.store(close_slots_ptr + token, tl.where(new_entry < 0, comp_scratch, new_entry))
        tl.store(close_positions_ptr + token, tl.maximum(window_id, 0) * RATIO)
        if OVERLAP > 0:
            state_row = state_ptr + owner * stride_state
            j = tl.arange(0, STATE_PAD)
            row_pos = tl.where(window_id >= 0, (window_id - OVERLAP + 1) * RATIO + j, -1)
            pooled = _slot(state_row, state_blocks, row_pos, state_rows, state_span, BLOCK_SIZE)
            tl.store(close_rows_ptr + token.to(tl.int64) * (OVERLAP * RATIO) + j, pooled, mask=j < OVERLAP * RATIO)
            own = _slot(state_row, state_blocks, position, state_rows, state_span, BLOCK_SIZE)
            tl.store(state_slots_ptr + token, tl.where(own < 0, state_scratch, own))


def _table(layout: SlotLayout, inputs, kind: str) -> tuple:
    table = inputs.tables[kind]
    if table.dtype != torch.int64 or table.stride(1) != 1:
        raise ValueError(f"block table {kind!r} must be int64 with unit-stride rows, got {table.dtype}, "
                         f"{table.stride()}")
    rows = layout.rows_per_block[kind]
    return table, table.stride(0), table.shape[1], rows, layout.block_size // rows, inputs.scratch_rows[kind]


def padded_slots(layout: SlotLayout, inputs) -> PaddedSlots:
    positions, owner = inputs.positions, inputs.owner
    if positions.dtype != torch.int64 or owner.dtype != torch.int64:
        raise ValueError(f"positions and owners must be int64, got {positions.dtype} and {owner.dtype}")
    size = layout.block_size
    if size & (size - 1):
        raise ValueError(f"the slot kernels need a power-of-two block size, got {size}")
    tokens, w, device = positions.shape[0], layout.window, positions.device
    window = torch.empty(tokens, w, dtype=torch.int64, device=device)
    swa_slots = torch.empty(tokens, dtype=torch.int64, device=device)
    if tokens:
        _window_kernel[(tokens,)](positions, owner, *_table(layout, inputs, "swa"), window, swa_slots, w,
                                  BLOCK_SIZE=size, W_PAD=triton.next_power_of_2(w), **LAUNCH)
    compressed = {}
    for ratio, overlap in layout.overlaps.items():
        width = inputs.candidates[ratio]
        candidates = torch.empty(tokens, width, dtype=torch.int64, device=device)
        close_rows = torch.empty(tokens, overlap * ratio, dtype=torch.int64, device=device)
        state_slots = torch.empty(tokens if overlap else 0, dtype=torch.int64, device=device)
        close_slots = torch.empty(tokens, dtype=torch.int64, device=device)
        close_positions = torch.empty(tokens, dtype=torch.int64, device=device)
        comp = _table(layout, inputs, f"comp{ratio}")
        state = _table(layout, inputs, f"state{ratio}") if overlap else comp  # unread without state
        if tokens:
            grid = (tokens, max(1, triton.cdiv(width, BLOCK_CANDIDATES)))
            _compressed_kernel[grid](positions, owner, *comp, *state, candidates, width, close_rows, state_slots,
                                     close_slots, close_positions, RATIO=ratio, OVERLAP=overlap, BLOCK_SIZE=size,
                                     BLOCK_C=BLOCK_CANDIDATES, STATE_PAD=triton.next_power_of_2(max(1, overlap * ratio)),
                                     **LAUNCH)
        compressed[ratio] = (state_slots, candidates, close_rows, close_slots, close_positions)
    return PaddedSlots(window, swa_slots, compressed)
