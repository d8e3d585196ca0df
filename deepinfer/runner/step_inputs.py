"""What the host sends for one step (``StepInputs``), and its padded form for a CUDA graph (``PaddedShape``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import torch

from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runtime.transfer import to_device


@dataclass(slots=True)
class StepInputs:
    """What the host sends for one step. Tensors (and dicts of tensors) travel; the ints fix the derived shapes."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    owner: torch.Tensor  # [T] row of each token's request in ``tables``
    logits_rows: torch.Tensor  # [B]
    tables: dict[str, torch.Tensor]  # cache kind -> [R, blocks] block ids, -1 where a request has none
    close_tokens: dict[int, torch.Tensor]  # ratio -> tokens whose window closes; empty dict: every token (padded)
    extras: dict[str, torch.Tensor]
    candidates: dict[int, int]  # ratio -> candidate columns
    scratch_rows: dict[str, int] | None = None  # padded batches: writes with no slot go to these rows
    # SWA bounded replay: the rows the window-only decoder layers run on, and for each the first position its
    # decoder window may see (its request's replay start); None: every row, nothing hidden
    replay_rows: torch.Tensor | None = None
    replay_floor: torch.Tensor | None = None
    # what work captured after the forward pass reads (``cuda_graphs.StepTail``), per padded request
    tail: dict[str, torch.Tensor] = field(default_factory=dict)

    def _tensors(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                yield f.name, None, value
            elif isinstance(value, dict) and value and isinstance(next(iter(value.values())), torch.Tensor):
                yield from ((f.name, key, t) for key, t in value.items())

    def to(self, device) -> "StepInputs":
        return self.map(lambda t: to_device(t, device))

    def map(self, fn) -> "StepInputs":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved.update({name: dict(moved[name]) for name in ("tables", "close_tokens", "extras", "tail")})
        for name, key, t in self._tensors():
            t = fn(t)
            if key is None:
                moved[name] = t
            else:
                moved[name][key] = t
        return StepInputs(**moved)

    def packed_like(self, device, pin_memory: bool = False) -> tuple[torch.Tensor, "StepInputs"]:
        """An empty byte buffer on ``device`` and inputs shaped like these whose tensors are views into it (each
        at a 16-byte boundary): a captured graph's static inputs and their staging copy travel as one copy."""
        spans = [-(-t.nbytes // 16) * 16 for _, _, t in self._tensors()]
        flat = torch.empty(sum(spans), dtype=torch.uint8, device=device, pin_memory=pin_memory)
        starts = iter(itertools.accumulate(spans, initial=0))
        views = self.map(lambda t: flat[(start := next(starts)):start + t.nbytes].view(t.dtype).view(t.shape))
        return flat, views

    def copy_(self, source: "StepInputs") -> None:
        """Overwrite these tensors in place (a staging buffer; a captured graph's static inputs) with ``source``'s;
        device-bound copies from pinned memory run without the host waiting."""
        for (_, _, target), (_, _, value) in zip(self._tensors(), source._tensors(), strict=True):
            target.copy_(value, non_blocking=True)


@dataclass(slots=True)
class PaddedShape:
    """The fixed shapes of a captured decode graph: ``num_tokens`` rows, ``tokens_per_request`` per request
    (padded requests own an empty block-table row), ``blocks`` table columns and ``candidates`` columns per
    compression ratio. Padded requests attend to nothing and write their rows to each pool's scratch row
    (``KVCache.scratch_rows``), as do real tokens whose compression window does not close in this step.

    With speculative decoding a request has its last token and its drafts, padded to ``tokens_per_request`` with
    tokens at the positions after them. Those positions are past everything the request has computed: whatever is
    written there is rewritten when the position is computed for real (as for rejected drafts), and the context
    bucket covers them, so no position is folded onto another's row."""

    num_tokens: int
    blocks: int
    candidates: dict[int, int]
    scratch_rows: dict[str, int]
    tokens_per_request: int = 1

    def pad(self, inputs: StepInputs) -> StepInputs:
        if inputs.logits_rows.shape[0] != inputs.token_ids.shape[0] or self.tokens_per_request != 1:
            raise ValueError("a padded (CUDA-graph) batch must sample every token: one-token decode steps only")
        n = self.num_tokens
        tables = {}
        for kind, table in inputs.tables.items():
            table = table[:, : self.blocks]  # blocks past the context bucket hold no position this step reads
            tables[kind] = pad_rows(torch.nn.functional.pad(table, (0, self.blocks - table.shape[1]), value=-1), n, -1)
        return StepInputs(
            token_ids=pad_rows(inputs.token_ids, n, 0),
            positions=pad_rows(inputs.positions, n, 0),
            owner=torch.arange(n),
            logits_rows=torch.arange(n),
            tables=tables,
            close_tokens={},
            extras={name: pad_rows(t, n, 0) for name, t in inputs.extras.items()},  # zeros: padded rows are ignored
            candidates=self.candidates,
            scratch_rows=self.scratch_rows,
        )


def real_rows(scheduled: ScheduledBatch, tokens_per_request: int) -> torch.Tensor:
    """Rows of a padded step's tokens that are the scheduled ones, in their order: request i's n tokens come
    first in its ``tokens_per_request`` rows."""
    return torch.tensor([i * tokens_per_request + j for i, row in enumerate(scheduled) for j in range(row.count)],
                        dtype=torch.int64)


def scatter_rows(t: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows, ...] zeros with ``t``'s rows at ``rows``, copied as bytes (Engram's FP8 rows have no index_copy)."""
    out = torch.zeros((num_rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out.view(torch.uint8).index_copy_(0, rows, t.contiguous().view(torch.uint8))
    return out


def pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])
