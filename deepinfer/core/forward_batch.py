"""Per-step tensors that tell the model where each token's state lives in the paged caches."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CompressedMeta:
    """Slots for one compression ratio ``r`` (every layer with that ratio shares them).

    ``state_slots``: where each token's compressor row (kv | score) is written.
    ``candidates``: compressed-entry slots each token may attend to (entries ``w < (p+1)//r``), -1 padded.
    ``close_rows``: for every window closing in this step, the state slots it pools
    (``coff * r`` rows; -1 where the window would start before position 0).
    ``close_slots``/``close_positions``: where the new entry goes and its RoPE position ``w*r``.
    """

    ratio: int
    overlap: int
    state_slots: torch.Tensor
    candidates: torch.Tensor
    close_rows: torch.Tensor
    close_slots: torch.Tensor
    close_positions: torch.Tensor


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    swa_slots: torch.Tensor  # [T] slot of each token's raw KV row
    window: torch.Tensor  # [T, W] raw KV slots each token attends to, -1 padded
    logits_rows: torch.Tensor  # [B] token rows whose next-token logits are needed
    compressed: dict[int, CompressedMeta] = field(default_factory=dict)
    # model-specific per-token inputs prepared on the host (the model's ``host_inputs``), first dim T
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device) -> "ForwardBatch":
        def move(obj, names):
            return [getattr(obj, name).to(device, non_blocking=True) for name in names]

        compressed = {r: CompressedMeta(m.ratio, m.overlap, *move(m, _META_FIELDS)) for r, m in self.compressed.items()}
        extras = {name: t.to(device, non_blocking=True) for name, t in self.extras.items()}
        return ForwardBatch(*move(self, _TENSOR_FIELDS), compressed=compressed, extras=extras)

    def copy_(self, source: "ForwardBatch") -> None:
        """Overwrite these tensors in place (the static inputs of a captured graph) with ``source``'s."""
        pairs = [(getattr(self, n), getattr(source, n)) for n in _TENSOR_FIELDS]
        for ratio, meta in self.compressed.items():
            pairs += [(getattr(meta, n), getattr(source.compressed[ratio], n)) for n in _META_FIELDS]
        pairs += [(t, source.extras[name]) for name, t in self.extras.items()]
        for target, value in pairs:
            target.copy_(value, non_blocking=True)


_TENSOR_FIELDS = ("token_ids", "positions", "swa_slots", "window", "logits_rows")
_META_FIELDS = ("state_slots", "candidates", "close_rows", "close_slots", "close_positions")


class ForwardBatchBuilder:
    """Turns the scheduled (request, first position, token count) triples into slot tensors."""

    def __init__(self, window: int, ratios: dict[int, int], block_size: int, rows_per_block: dict[str, int], device,
                 token_history: int = 0, host_inputs=None):
        self.window = window
        # compression ratio -> how many windows pool each compressor-state row (2 for V4's CSA, 1 for HCA and
        # V4.1's ratio 2, 0 where no compressor state is kept)
        self.ratios = ratios
        # (token_ids [T], history [T, token_history]) -> the model's extra inputs, when it looks at earlier tokens
        self.token_history, self.host_inputs = token_history, host_inputs
        self.block_size = block_size
        self.rows_per_block = rows_per_block
        self.device = device

    def _tables(self, requests, kind: str) -> torch.Tensor:
        rows = [r.tables.get(kind, ()) for r in requests]
        width = max(1, max(map(len, rows)))
        # one tensor from padded lists: per-request tensors cost more host time than the rest of the step's build
        return torch.tensor([[*blocks, *(-1,) * (width - len(blocks))] for blocks in rows], dtype=torch.int64)

    def _slots(self, table: torch.Tensor, kind: str, owner: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row slot of ``positions`` (any shape, paired with ``owner``); -1 for positions < 0."""
        valid = positions >= 0
        pos = positions.clamp(min=0)
        block = table[owner, (pos // self.block_size).clamp(max=table.shape[1] - 1)]
        rows = self.rows_per_block[kind]
        slot = block * rows + (pos % self.block_size) // (self.block_size // rows)
        return torch.where(valid & (block >= 0), slot, -1)

    def build(self, scheduled: list[tuple[object, int, int]], padded: "PaddedShape | None" = None,
              on_host: bool = False) -> ForwardBatch:
        """Slot tensors for the step; with ``padded``, shaped for a captured CUDA graph (see ``PaddedShape``).
        ``on_host`` leaves them in host memory (for a copy straight into a graph's inputs)."""
        requests = [r for r, _, _ in scheduled]
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in scheduled])
        owner = torch.cat([torch.full((n,), i) for i, (_, _, n) in enumerate(scheduled)])
        token_ids = torch.tensor([t for r, start, n in scheduled for t in r.token_ids[start : start + n]])
        last_rows = torch.cumsum(torch.tensor([n for _, _, n in scheduled]), 0) - 1
        wants_logits = torch.tensor([start + n == len(r.token_ids) for r, start, n in scheduled])

        swa = self._tables(requests, "swa")
        window_pos = positions.unsqueeze(1) - self.window + 1 + torch.arange(self.window)
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            swa_slots=self._slots(swa, "swa", owner, positions),
            window=self._slots(swa, "swa", owner.unsqueeze(1), window_pos),
            logits_rows=last_rows[wants_logits],
        )
        for ratio, overlap in self.ratios.items():
            width = None if padded is None else padded.candidates[ratio]
            batch.compressed[ratio] = self._compressed(requests, owner, positions, ratio, overlap, width)
        if self.token_history:
            batch.extras = self.host_inputs(token_ids, self._history(scheduled))
        if padded is not None:
            batch = padded.pad(batch)
        return batch if on_host or self.device is None else batch.to(self.device)

    def _history(self, scheduled) -> torch.Tensor:
        h = self.token_history
        windows = []
        for request, start, n in scheduled:
            before = max(0, h - start)  # positions before the sequence start
            ids = [-1] * before + request.token_ids[start - h + before : start + n - 1]
            windows.append(torch.tensor(ids, dtype=torch.int64).unfold(0, h, 1))
        return torch.cat(windows)

    def _compressed(self, requests, owner, positions, ratio: int, overlap: int, width: int | None) -> CompressedMeta:
        """Without ``width`` only the windows closing in this step are listed; with it, every token gets a close
        row (-1 slots where its window does not close) and ``width`` candidate columns, so shapes stay fixed."""
        comp_kind, state_kind = f"comp{ratio}", f"state{ratio}"
        comp = self._tables(requests, comp_kind)
        visible = (positions + 1) // ratio
        entries = torch.arange(int(visible.max()) if width is None else width)
        entry_pos = torch.where(entries < visible.unsqueeze(1), entries * ratio, -1)
        closing = (positions + 1) % ratio == 0
        if width is None:
            close_tokens = closing.nonzero().flatten()
        else:
            close_tokens = torch.arange(len(positions))
        window_ids = torch.where(closing, visible - 1, -1)[close_tokens]
        close_owner = owner[close_tokens]
        row_pos = (window_ids - overlap + 1).unsqueeze(1) * ratio + torch.arange(overlap * ratio)
        row_pos = torch.where(window_ids.unsqueeze(1) >= 0, row_pos, -1)
        if overlap:
            state = self._tables(requests, state_kind)
            state_slots = self._slots(state, state_kind, owner, positions)
            close_rows = self._slots(state, state_kind, close_owner.unsqueeze(1), row_pos)
        else:
            state_slots, close_rows = torch.empty(0, dtype=torch.int64), row_pos[:, :0]
        return CompressedMeta(
            ratio=ratio,
            overlap=overlap,
            state_slots=state_slots,
            candidates=self._slots(comp, comp_kind, owner.unsqueeze(1), entry_pos),
            close_rows=close_rows,
            close_slots=self._slots(comp, comp_kind, close_owner, window_ids * ratio),
            close_positions=window_ids.clamp(min=0) * ratio,
        )


def _pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])


@dataclass(slots=True)
class PaddedShape:
    """The fixed shapes of a captured decode graph, and how a smaller batch is padded to them.

    Padded tokens attend to nothing and write their rows to each pool's scratch row (``KVCache.scratch_rows``),
    as do real tokens whose compression window does not close in this step.
    """

    num_tokens: int
    candidates: dict[int, int]  # compression ratio -> candidate columns
    scratch_rows: dict[str, int]  # cache kind -> its scratch row

    def pad(self, batch: ForwardBatch) -> ForwardBatch:
        if batch.logits_rows.shape[0] != batch.token_ids.shape[0]:
            raise ValueError("a padded (CUDA-graph) batch must sample every token: decode steps only")
        n = self.num_tokens
        compressed = {}
        for ratio, m in batch.compressed.items():
            comp, state = self.scratch_rows[f"comp{ratio}"], self.scratch_rows.get(f"state{ratio}", 0)
            compressed[ratio] = CompressedMeta(
                ratio=m.ratio,
                overlap=m.overlap,
                state_slots=_pad_rows(m.state_slots, n, state) if m.overlap else m.state_slots,
                candidates=_pad_rows(m.candidates, n, -1),
                close_rows=_pad_rows(m.close_rows, n, -1),
                close_slots=_pad_rows(torch.where(m.close_slots < 0, comp, m.close_slots), n, comp),
                close_positions=_pad_rows(m.close_positions, n, 0),
            )
        return ForwardBatch(
            token_ids=_pad_rows(batch.token_ids, n, 0),
            positions=_pad_rows(batch.positions, n, 0),
            swa_slots=_pad_rows(batch.swa_slots, n, self.scratch_rows["swa"]),
            window=_pad_rows(batch.window, n, -1),
            logits_rows=torch.arange(n),
            compressed=compressed,
            extras={name: _pad_rows(t, n, 0) for name, t in batch.extras.items()},  # zeros: padded tokens are ignored
        )
