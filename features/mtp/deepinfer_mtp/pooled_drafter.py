"""What the DSpark and MTP drafters share: per-request rows in a ``ContextPool``, a draft pass that takes three
integers per request (so it can replay from ``DraftGraphs``), and the ``Drafter`` protocol around them."""

from __future__ import annotations

import torch

from deepinfer.plugins.interfaces import ComputedRows, Draft
from deepinfer_mtp.context_pool import ContextPool
from deepinfer_mtp.draft_graphs import DraftGraphs


class PooledDrafter:
    """Subclasses set ``pool`` and ``device`` and define ``_store(computed)`` (the last step's rows into the
    pool) and ``_draft(inputs [3, B]) -> tensors [B, ...]`` (each output row's values become one ``Draft``'s
    fields, in order). A pass starts ``anchor_back`` positions before the end of a request's tokens."""

    anchor_back = 1
    pool: ContextPool
    device: torch.device
    graphs: DraftGraphs | None = None

    def use_cuda_graphs(self, batch_sizes: list[int]) -> None:
        """The engine replays its decode steps from CUDA graphs: replay the draft pass from graphs too."""
        self.graphs = DraftGraphs(self._draft, batch_sizes, self.pool.empty, self.device)

    def propose(self, requests: list, computed: list[ComputedRows]) -> list[Draft]:
        self._store(computed)
        self.pool.release_finished()
        if not requests:
            return []
        inputs = torch.tensor([[r.token_ids[-1] for r in requests],
                               [len(r.token_ids) - self.anchor_back for r in requests],
                               [self.pool.slot(r) for r in requests]], dtype=torch.int64)
        if self.graphs is not None and self.graphs.fits(len(requests)):
            outputs = self.graphs(inputs)
        else:
            outputs = self._draft(inputs.to(self.device))
        return [Draft(*values) for values in zip(*(t.tolist() for t in outputs))]

    def _store(self, computed: list[ComputedRows]) -> None:
        raise NotImplementedError

    def _draft(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError
