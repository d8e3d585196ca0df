"""Per-step tensors that tell the model where each token's state lives in the paged caches.

The host sends little (``StepInputs``): each token's id, position and request, each request's block table per cache
kind, and which tokens close a compression window. Every slot the model reads or writes (``ForwardBatch``) is
derived from those on the device (``ForwardBatchBuilder.derive``). So a step's host work and host-to-device bytes
grow with the block tables (a request's positions / block_size), not with tokens x window or tokens x candidates
(a long prefill's candidate lists alone are hundreds of MB), and a captured CUDA graph derives the slots itself from
its static inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runtime.slots import SlotLayout, padded_slots, slot_of, window_positions
from deepinfer.runner.step_inputs import PaddedShape, StepInputs, pad_rows, real_rows, scatter_rows


@dataclass(slots=True)
class CompressedMeta:
    """Slots for one compression ratio ``r`` (every layer with that ratio shares them).

    ``state_slots``: where each token's compressor row (kv | score) is written.
    ``candidates``: compressed-entry slots each token may attend to (entries ``w < (p+1)//r``), -1 padded.
    ``close_rows``: for every window closing in this step, the state slots it pools
    (``coff * r`` rows; -1 where the window would start before position 0).
    ``close_slots``/``close_positions``: where the new entry goes and its RoPE position ``w*r``.
    ``close_phases``: those positions' RoPE phases, set by the model once per step for all its layers of ratio ``r``.
    """

    ratio: int
    overlap: int
    state_slots: torch.Tensor
    candidates: torch.Tensor
    close_rows: torch.Tensor
    close_slots: torch.Tensor
    close_positions: torch.Tensor
    close_phases: torch.Tensor | None = None


@dataclass(slots=True)
class ImageRows:
    """The step's rows that hold image-span positions (``runtime/images.py``) and what they hold: the vision
    encoder's embeddings, which replace the token embeddings there and mark the rows as image tokens."""

    rows: torch.Tensor  # [N] step rows
    embeddings: torch.Tensor  # [N, hidden]

    def mask(self, num_rows: int) -> torch.Tensor:
        """[num_rows] bool: which rows are image tokens."""
        mask = torch.zeros(num_rows, dtype=torch.bool, device=self.rows.device)
        return mask.index_fill_(0, self.rows, True)

    def among(self, rows: torch.Tensor, num_rows: int) -> "ImageRows":
        """The image rows among ``rows`` (context parallelism: a rank's share of the step's ``num_rows`` rows, in
        step order), numbered as rows of that share."""
        local = torch.full((num_rows,), -1, dtype=torch.int64, device=rows.device)
        local[rows] = torch.arange(rows.numel(), device=rows.device)
        mine = local[self.rows]
        kept = mine >= 0
        return ImageRows(mine[kept], self.embeddings[kept])


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
    # SWA bounded replay: the rows the decoder layers run on and their own batch (None: every row, as is)
    replay: DecoderReplay | None = None
    # context parallelism: this rank's share of the step's rows (``deepinfer.parallel.context_parallel``)
    context: object | None = None
    # the step's image rows (a model with a vision tower; None: every row is text)
    images: ImageRows | None = None

    def own_rows(self) -> "ForwardBatch":
        """Context parallelism: the step with its per-token inputs (ids, positions, what each token attends to,
        extras, image rows) cut to this rank's rows. Cache writes still cover every row (every rank's caches hold
        the whole step, written from ``gather``ed rows)."""
        if self.context is None:
            return self
        rows = self.context.rows
        compressed = {ratio: dataclasses.replace(meta, candidates=meta.candidates[rows])
                      for ratio, meta in self.compressed.items()}
        images = None if self.images is None else self.images.among(rows, self.token_ids.shape[0])
        return dataclasses.replace(self, token_ids=self.token_ids[rows], positions=self.positions[rows],
                                   window=self.window[rows], compressed=compressed,
                                   extras={name: t[rows] for name, t in self.extras.items()}, images=images)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token rows of this rank's tokens -> the rows of every token of the step (context parallelism;
        without it they already are)."""
        return rows if self.context is None else self.context.gather(rows)


@dataclass(slots=True)
class DecoderReplay:
    """The sub-batch window-only decoder layers run on: ``rows`` [T'] of the step, each with its slots and its
    decoder window cut at its request's replay start (rows before it were never computed by those layers)."""

    rows: torch.Tensor
    batch: ForwardBatch


def _rows_of(meta: CompressedMeta, rows: torch.Tensor) -> CompressedMeta:
    """What readers of compressed entries see for ``rows``: their candidates. Decoder layers own no compressor,
    so nothing is written there."""
    return CompressedMeta(meta.ratio, meta.overlap, meta.state_slots[:0], meta.candidates[rows],
                          meta.close_rows[:0], meta.close_slots[:0], meta.close_positions[:0])


def _int64(values: list[int]) -> torch.Tensor:
    """A flat int64 tensor of a list, through numpy: several times faster than ``torch.tensor`` on Python ints."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


class ForwardBatchBuilder:
    """Turns a ``ScheduledBatch`` into ``StepInputs`` on the host, and those into slot tensors (``derive``)
    wherever they are."""

    def __init__(self, window: int, ratios: dict[int, int], block_size: int, rows_per_block: dict[str, int], device,
                 token_history: int = 0, host_inputs=None, slot_backend=None, image_rows=None):
        # window, block size, rows per block of each cache kind, and per compression ratio how many windows pool
        # each compressor-state row (2 for V4's CSA, 1 for HCA and V4.1's ratio 2, 0 where no state is kept)
        self.layout = SlotLayout(window, block_size, rows_per_block, ratios)
        # (token_ids [T], history [T, token_history]) -> the model's extra inputs, when it looks at earlier tokens
        self.token_history, self.host_inputs = token_history, host_inputs
        self.device = device
        # an ``AttentionBackend``: it derives padded steps' slots (``padded_slots``); None: the torch reference
        self.slot_backend = slot_backend
        # a ``ScheduledBatch`` -> its ``ImageRows`` or None (``EncoderCache.step_images``); None: a text-only model
        self.image_rows = image_rows

    def build(self, scheduled: ScheduledBatch) -> ForwardBatch:
        inputs = self.inputs(scheduled)
        batch = self.derive(inputs if self.device is None else inputs.to(self.device))
        if self.image_rows is not None:
            batch.images = self.image_rows(scheduled)
        return batch

    # -- host side ----------------------------------------------------------------------------
    def inputs(self, scheduled: ScheduledBatch, padded: PaddedShape | None = None,
               values_on_device: bool = False) -> StepInputs:
        """``values_on_device``: a padded step whose token ids and token history the device writes before it runs
        (overlapped speculative decoding: the host does not have them yet); they are sent as zeros."""
        if padded is not None and all(row.count <= padded.tokens_per_request for row in scheduled):
            return self._padded_decode_inputs(scheduled, padded, values_on_device)
        requests = scheduled.requests
        positions = torch.cat([torch.arange(row.start, row.end) for row in scheduled])
        owner = torch.cat([torch.full((row.count,), i) for i, row in enumerate(scheduled)])
        token_ids = torch.tensor([t for row in scheduled for t in row.request.token_ids[row.start:row.end]])
        logits_rows, end = [], 0
        for row in scheduled:  # a request's last token, and each draft (speculative decoding) to verify
            end += row.count
            if row.samples:
                logits_rows.extend(range(end - 1 - row.drafts, end))
        replay_rows, replay_floor = self._replay(scheduled)
        ends = positions + 1
        # a padded batch has fixed candidate widths and closes a row per token: only unpadded ones need these
        closing = {} if padded else {r: (ends % r == 0).nonzero().flatten() for r in self.layout.overlaps}
        widths = {} if padded else {r: int((ends // r).max()) for r in self.layout.overlaps}
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            owner=owner,
            logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
            tables={kind: self._tables(requests, kind) for kind in self.layout.rows_per_block},
            close_tokens=closing,
            extras=self.host_inputs(token_ids, self._history(scheduled)) if self.token_history else {},
            candidates=widths,
            replay_rows=replay_rows,
            replay_floor=replay_floor,
        )
        return inputs if padded is None else padded.pad(inputs)

    def _replay(self, scheduled) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decoder layers' rows and window floors, when some request's replay start hides a row or a row's
        window from them; (None, None) otherwise (every decode step: its window lies past the replay start)."""
        if all(not row.request.replay_start or row.start - self.layout.window + 1 >= row.request.replay_start
               for row in scheduled):
            return None, None
        rows, floors, first = [], [], 0
        for row in scheduled:
            replay_start = row.request.replay_start
            kept = min(max(row.start, replay_start), row.end)
            rows.append(torch.arange(first + kept - row.start, first + row.count))
            floors.append(torch.full((row.end - kept,), replay_start))
            first += row.count
        return torch.cat(rows), torch.cat(floors)

    def _padded_decode_inputs(self, scheduled, padded: PaddedShape, values_on_device: bool) -> StepInputs:
        """``padded.pad(self.inputs(scheduled))`` for a decode step (or a verification step: ``tokens_per_request``
        rows per request, ``real_rows`` says which hold its tokens), built as flat padded lists and one tensor each:
        every replayed step comes here, and at batch 64 building the inputs was the largest part of the host's
        step."""
        q, blocks = padded.tokens_per_request, padded.blocks
        requests = padded.num_tokens // q
        token_ids, positions = [], []
        for row in scheduled:
            ids = row.request.token_ids
            token_ids += [0] * q if values_on_device else ids[row.start:row.end] + [0] * (q - row.count)
            positions += range(row.start, row.start + q)
        pad = [0] * (padded.num_tokens - len(token_ids))
        tables = {}
        for kind in self.layout.rows_per_block:
            flat = []
            for r in scheduled.requests:
                table = r.tables.get(kind, ())[:blocks]
                flat += table
                flat += [-1] * (blocks - len(table))
            flat += [-1] * (blocks * (requests - len(scheduled)))
            tables[kind] = _int64(flat).view(requests, blocks)
        extras = {}
        if self.token_history and values_on_device:
            real = self.host_inputs(torch.zeros(len(token_ids), dtype=torch.int64),
                                    torch.zeros(len(token_ids), self.token_history, dtype=torch.int64))
            extras = {name: pad_rows(t, padded.num_tokens, 0) for name, t in real.items()}
        elif self.token_history:  # computed for the real tokens; padded rows are ignored (zeros)
            real = self.host_inputs(_int64([t for row in scheduled for t in row.request.token_ids[row.start:row.end]]),
                                    self._history(scheduled))
            if q == 1:  # the real rows come first
                extras = {name: pad_rows(t, padded.num_tokens, 0) for name, t in real.items()}
            else:
                rows = real_rows(scheduled, q)
                extras = {name: scatter_rows(t, rows, padded.num_tokens) for name, t in real.items()}
        return StepInputs(
            token_ids=_int64(token_ids + pad),
            positions=_int64(positions + pad),
            owner=torch.arange(requests).repeat_interleave(q),
            logits_rows=torch.arange(padded.num_tokens),
            tables=tables,
            close_tokens={},
            extras=extras,
            candidates=padded.candidates,
            scratch_rows=padded.scratch_rows,
        )

    def _tables(self, requests, kind: str) -> torch.Tensor:
        rows = [r.tables.get(kind, ()) for r in requests]
        width = max(1, max(map(len, rows)))
        # one tensor from padded lists: per-request tensors cost more host time than the rest of the step
        return torch.tensor([[*blocks, *(-1,) * (width - len(blocks))] for blocks in rows], dtype=torch.int64)

    def _history(self, scheduled: ScheduledBatch) -> torch.Tensor:
        """[T, h]: the ``h`` ids before each scheduled token, -1 before its sequence's start; one tensor from
        lists (a tensor per request cost a decode step at batch 64 more than the rest of its inputs)."""
        h = self.token_history
        flat = []
        for row in scheduled:
            ids = row.request.token_ids
            for p in range(row.start, row.end):
                flat += ids[p - h:p] if p >= h else [-1] * (h - p) + ids[:p]
        return _int64(flat).view(-1, h)

    # -- wherever the inputs are (the device; inside a captured graph) --------------------------
    def derive(self, inputs: StepInputs) -> ForwardBatch:
        if inputs.scratch_rows is not None:  # padded: what a CUDA graph replays
            return self._padded(inputs)
        positions, owner = inputs.positions, inputs.owner
        window_pos = window_positions(self.layout, positions)
        window = slot_of(self.layout, inputs.tables["swa"], "swa", owner.unsqueeze(1), window_pos)
        batch = ForwardBatch(
            token_ids=inputs.token_ids,
            positions=positions,
            swa_slots=window[:, -1],  # a token's own row ends its window
            window=window,
            logits_rows=inputs.logits_rows,
            extras=inputs.extras,
        )
        for ratio, overlap in self.layout.overlaps.items():
            batch.compressed[ratio] = self._compressed(inputs, ratio, overlap)
        if inputs.replay_rows is not None:
            rows = inputs.replay_rows
            seen = window_pos[rows] >= inputs.replay_floor.unsqueeze(1)
            batch.replay = DecoderReplay(rows, ForwardBatch(
                token_ids=batch.token_ids[rows],
                positions=positions[rows],
                swa_slots=batch.swa_slots[rows],
                window=torch.where(seen, window[rows], -1),
                logits_rows=rows.new_empty(0),  # the model hands the decoder's rows back in step order
                compressed={r: _rows_of(meta, rows) for r, meta in batch.compressed.items()},
                extras={name: t[rows] for name, t in batch.extras.items()},
            ))
        return batch

    def _padded(self, inputs: StepInputs) -> ForwardBatch:
        derive = padded_slots if self.slot_backend is None else self.slot_backend.padded_slots
        slots = derive(self.layout, inputs)
        return ForwardBatch(
            token_ids=inputs.token_ids,
            positions=inputs.positions,
            swa_slots=slots.swa_slots,
            window=slots.window,
            logits_rows=inputs.logits_rows,
            compressed={ratio: CompressedMeta(ratio, overlap, *slots.compressed[ratio])
                        for ratio, overlap in self.layout.overlaps.items()},
            extras=inputs.extras,
        )

    def _compressed(self, inputs: StepInputs, ratio: int, overlap: int) -> CompressedMeta:
        """The slots of an unpadded step's compressed entries: only the windows closing in this step are listed."""
        positions, owner = inputs.positions, inputs.owner
        device = positions.device
        comp_kind, state_kind = f"comp{ratio}", f"state{ratio}"
        comp = inputs.tables[comp_kind]
        visible = (positions + 1) // ratio
        entries = torch.arange(inputs.candidates[ratio], device=device)
        entry_pos = torch.where(entries < visible.unsqueeze(1), entries * ratio, -1)
        close_tokens = inputs.close_tokens[ratio]
        window_ids, close_owner = visible[close_tokens] - 1, owner[close_tokens]
        # positions before the sequence start (the first window's older half) have no slot: ``slot_of`` gives -1
        row_pos = (window_ids - overlap + 1).unsqueeze(1) * ratio + torch.arange(overlap * ratio, device=device)
        if overlap:
            state = inputs.tables[state_kind]
            close_rows = slot_of(self.layout, state, state_kind, close_owner.unsqueeze(1), row_pos)
            state_slots = slot_of(self.layout, state, state_kind, owner, positions)
        else:
            state_slots, close_rows = torch.empty(0, dtype=torch.int64, device=device), row_pos[:, :0]
        return CompressedMeta(
            ratio=ratio,
            overlap=overlap,
            state_slots=state_slots,
            candidates=slot_of(self.layout, comp, comp_kind, owner.unsqueeze(1), entry_pos),
            close_rows=close_rows,
            close_slots=slot_of(self.layout, comp, comp_kind, close_owner, window_ids * ratio),
            close_positions=window_ids * ratio,
        )
