"""What the DSpark and MTP drafters share: per-request rows in a ``ContextPool``, a draft pass that takes three
integers per request (so it can replay from ``DraftGraphs``), and the ``Drafter`` protocol around them."""

from __future__ import annotations

import torch

from deepinfer.plugins.interfaces import ComputedRows, Draft
from deepinfer_mtp.context_pool import ContextPool
from deepinfer_mtp.draft_graphs import DraftGraphs


class PooledDrafter:
    """Subclasses set ``pool`` and ``device`` and define ``_store(computed, features)`` (the last step's rows
    into the pool, from the host's bookkeeping), ``_write(...)`` (the same on the device, which ``_store`` ends
    with) and
    ``_draft(inputs [3, B]) -> tensors [B, ...]`` (each output row's values become one ``Draft``'s fields, in
    order). A pass starts ``anchor_back`` positions before the end of a request's tokens."""

    anchor_back = 1
    pool: ContextPool
    device: torch.device
    graphs: DraftGraphs | None = None

    def use_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """The engine replays its decode steps from CUDA graphs: replay the draft pass from graphs too."""
        self.graphs = DraftGraphs(batch_sizes, self.pool.empty, self.device)

    def propose(self, requests: list, computed: list[ComputedRows], features: torch.Tensor | None) -> list[Draft]:
        if computed:  # none after plain steps that stored their rows on the device (``store_on_device``)
            self._store(computed, features)
        self.pool.release_finished()
        if not requests:
            return []
        inputs = torch.tensor([[r.token_ids[-1] for r in requests],
                               [len(r.token_ids) - self.anchor_back for r in requests],
                               [self.pool.slot(r) for r in requests]], dtype=torch.int64)
        if self.graphs is not None and self.graphs.fits(len(requests)):
            outputs = self.graphs(self._draft, inputs)
        else:
            outputs = self._draft(inputs.to(self.device))
        return [Draft(*values) for values in zip(*(t.tolist() for t in outputs))]

    def device_slots(self, requests: list) -> list[int]:
        """``Drafter.device_slots``: each request's slot in the pool."""
        self.pool.release_finished()
        return [self.pool.slot(r) for r in requests]

    def propose_on_device(self, slots: torch.Tensor, positions: torch.Tensor, rows: int, kept: torch.Tensor,
                          sampled: torch.Tensor, features: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``Drafter.propose_on_device``: the step's rows into the pool (the kept ones; the others, and padding
        requests', go to the empty slot, whose rows no request reads), then one draft pass from each request's new
        last token. It runs inside the engine's step graph, or eagerly where the engine captures none: never from
        the drafter's own graphs."""
        device = positions.device
        slots = torch.where(slots < 0, self.pool.empty, slots)
        offsets = torch.arange(rows, device=device)
        # a ring of ``length`` rows holds the last ``window`` positions: older kept rows would wrap onto newer ones
        keep = (offsets < kept.unsqueeze(1)) & (offsets >= kept.unsqueeze(1) - self.pool.window)
        first_row = torch.arange(len(slots), device=device) * rows
        self._write(features, (first_row.unsqueeze(1) + offsets).flatten(), (positions.unsqueeze(1) + offsets).flatten(),
                    torch.where(keep, slots.unsqueeze(1), self.pool.empty).flatten(), sampled.flatten(),
                    slots, first_row + kept - 1)
        last = sampled.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        outputs = self._draft(torch.stack([last, positions + kept + 1 - self.anchor_back, slots]))
        return outputs[0], outputs[1] if len(outputs) > 1 else None

    def store_on_device(self, slots: torch.Tensor, positions: torch.Tensor, sampled: torch.Tensor,
                        features: torch.Tensor | None) -> None:
        """``Drafter.store_on_device``: a plain step's rows (one a request) into the pool, no draft pass; a slot
        of -1 (a request already finished) writes to the empty slot."""
        slots = torch.where(slots < 0, self.pool.empty, slots)
        rows = torch.arange(len(slots), device=positions.device)
        self._write(features, rows, positions, slots, sampled, slots, rows)

    def _store(self, computed: list[ComputedRows], features: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _write(self, features: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               next_tokens: torch.Tensor, last_slots: torch.Tensor, last_rows: torch.Tensor) -> None:
        """On the device: the step's ``rows`` [N] (into its ``features``) at ``positions`` [N] of pool
        ``slots`` [N], each paired with the token after it, ``next_tokens`` [N]; ``last_rows`` [B]: each request's
        last kept row, in ``last_slots`` [B]."""
        raise NotImplementedError

    def _draft(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError
