"""Paged-cache slot arithmetic: where a (request, position) pair's row lives, and every slot a padded decode step
reads or writes, derived from its ``StepInputs``.

``padded_slots`` is the reference for ``AttentionBackend.padded_slots``: a CUDA graph replays it every decode step,
where its ~25 small integer ops per cache kind are as many kernels; a backend may compute the same in a few.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class SlotLayout:
    """How positions map to rows: ``block_size`` positions per block, ``rows_per_block[kind]`` rows of each cache
    kind per block, a ``window`` of raw rows per token, and per compression ratio how many windows pool each
    compressor-state row (``overlaps``; 0 where no state is kept)."""

    window: int
    block_size: int
    rows_per_block: dict[str, int]
    overlaps: dict[int, int]


def slot_of(layout: SlotLayout, table: torch.Tensor, kind: str, owner: torch.Tensor, positions: torch.Tensor
            ) -> torch.Tensor:
    """Row slot of ``positions`` (any shape, paired with ``owner``, rows of ``table``); -1 for positions < 0 or
    without a block. The masks fold into one sign test of ``positions | block``."""
    size, rows = layout.block_size, layout.rows_per_block[kind]
    block = table[owner, (positions // size).clamp(0, table.shape[1] - 1)]
    within = positions % size if rows == size else positions % size // (size // rows)
    return torch.where((positions | block) >= 0, block * rows + within, -1)


def written(inputs, kind: str, slots: torch.Tensor) -> torch.Tensor:
    """Slots written to: in a padded batch, the ones without a row go to the pool's scratch row."""
    return slots if inputs.scratch_rows is None else torch.where(slots < 0, inputs.scratch_rows[kind], slots)


def window_positions(layout: SlotLayout, positions: torch.Tensor) -> torch.Tensor:
    """[T, window]: the positions each token attends to in the sliding window, its own last."""
    return positions.unsqueeze(1) - layout.window + 1 + torch.arange(layout.window, device=positions.device)


@dataclass(slots=True)
class PaddedSlots:
    """A padded step's slots: ``window`` [T, W] and ``swa_slots`` [T], and per ratio the fields of
    ``forward_batch.CompressedMeta`` in its padded form (every token has a close row; -1 / scratch where its
    window does not close): ``state_slots`` [T] ([0] without state), ``candidates`` [T, C], ``close_rows``
    [T, overlap * ratio], ``close_slots`` [T], ``close_positions`` [T]."""

    window: torch.Tensor
    swa_slots: torch.Tensor
    compressed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def padded_slots(layout: SlotLayout, inputs) -> PaddedSlots:
    """Every slot of a padded step (``inputs.scratch_rows`` set, ``close_tokens`` empty): each table's lookups for
    a token share one ``slot_of`` call."""
    positions, owner = inputs.positions, inputs.owner
    device = positions.device
    window = slot_of(layout, inputs.tables["swa"], "swa", owner.unsqueeze(1), window_positions(layout, positions))
    compressed = {}
    for ratio, overlap in layout.overlaps.items():
        comp_kind, state_kind = f"comp{ratio}", f"state{ratio}"
        visible = (positions + 1) // ratio
        entries = torch.arange(inputs.candidates[ratio], device=device)
        entry_pos = torch.where(entries < visible.unsqueeze(1), entries * ratio, -1)
        window_ids = torch.where((positions + 1) % ratio == 0, visible - 1, -1)
        if overlap:
            row_pos = (window_ids - overlap + 1).unsqueeze(1) * ratio + torch.arange(overlap * ratio, device=device)
            row_pos = torch.where(window_ids.unsqueeze(1) >= 0, row_pos, -1)
            rows = slot_of(layout, inputs.tables[state_kind], state_kind, owner.unsqueeze(1),
                           torch.cat((row_pos, positions[:, None]), 1))
            close_rows, state_slots = rows[:, :-1], written(inputs, state_kind, rows[:, -1])
        else:
            close_rows = torch.empty(positions.shape[0], 0, dtype=torch.int64, device=device)
            state_slots = torch.empty(0, dtype=torch.int64, device=device)
        comp_slots = slot_of(layout, inputs.tables[comp_kind], comp_kind, owner.unsqueeze(1),
                             torch.cat((entry_pos, window_ids.unsqueeze(1) * ratio), 1))
        compressed[ratio] = (state_slots, comp_slots[:, :-1], close_rows, written(inputs, comp_kind, comp_slots[:, -1]),
                             window_ids.clamp(min=0) * ratio)
    return PaddedSlots(window, written(inputs, "swa", window[:, -1]), compressed)
