"""Per-request rows a drafter keeps on the device, one slot per request, addressed by position."""

from __future__ import annotations

from collections import OrderedDict

import torch


class ContextPool:
    """A drafter's rows per request slot (DSpark's projected target features, MTP's window rows) for the last
    ``window`` positions, plus ``lookahead`` rows a drafter may write past them (MTP's chain) without overwriting
    any of those: position ``p`` lives in row ``p % length`` (``positions`` -1: empty). The last slot belongs to no
    request:
    a graph's padding rows read (and MTP's write) it. Slots are reused least recently used first; a request that
    loses its slot (preempted long ago) drafts from what it computes next, which costs acceptance, never
    correctness."""

    def __init__(self, slots: int, window: int, width: int, dtype: torch.dtype, device: torch.device,
                 lookahead: int = 0):
        self.length = window + lookahead
        self.rows = torch.zeros(slots + 1, self.length, width, dtype=dtype, device=device)
        self.positions = torch.full((slots + 1, self.length), -1, dtype=torch.int64, device=device)
        self.empty = slots
        self.window = window
        self._slots: OrderedDict[int, tuple[object, int]] = OrderedDict()  # id(request) -> (request, slot)
        self._free = list(range(slots - 1, -1, -1))

    def slot(self, request) -> int:
        key = id(request)
        entry = self._slots.get(key)
        if entry is not None and entry[0] is request:
            self._slots.move_to_end(key)
            return entry[1]
        if entry is not None:  # a finished request's id reused by a new one
            self._free.append(self._slots.pop(key)[1])
        slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1][1]
        self.positions[slot] = -1
        self._slots[key] = (request, slot)
        return slot

    def release_finished(self) -> None:
        for key in [k for k, (r, _) in self._slots.items() if r.finished]:
            self._free.append(self._slots.pop(key)[1])

    def write(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows [N, width] at ``positions`` [N] of ``slots`` [N]; no two of them share a (slot, row)."""
        ring = positions % self.length
        self.rows[slots, ring] = rows
        self.positions[slots, ring] = positions

    def view(self, request) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's rows [length, width] and their positions [length] (tests read them)."""
        slot = self._slots[id(request)][1]
        return self.rows[slot], self.positions[slot]


    def visible(self, slots: torch.Tensor, positions: torch.Tensor, own_row: bool) -> torch.Tensor:
        """[B, length] flat row ids (into ``rows.flatten(0, 1)``) a query at ``positions`` [B] of ``slots`` [B]
        may read, -1 elsewhere: the ``window - 1`` positions before it and, with ``own_row``, its own (about to be
        written at row ``position % length``, so not yet in ``positions``)."""
        held = self.positions[slots]  # [B, length]
        query = positions.unsqueeze(1)
        visible = (held >= 0) & (held < query) & (held > query - self.window)
        ring = torch.arange(self.length, device=held.device)
        if own_row:
            visible |= ring == query % self.length
        return torch.where(visible, slots.unsqueeze(1) * self.length + ring, -1)
