"""Drafting with DSpark: each request keeps the draft's context (its last ``window`` projected target features),
and after every step one draft pass proposes a block of tokens for every request that decodes next."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v41.dspark import DraftInputs, DSparkDraft
from deepinfer.plugins.interfaces import ComputedRows, Draft


@dataclass(slots=True)
class _Context:
    """A ring of projected features: position ``p`` lives in row ``p % window`` (``positions`` -1: empty)."""

    rows: torch.Tensor  # [window, hidden]
    positions: torch.Tensor  # [window] int64

    def write(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        slots = positions % self.rows.shape[0]
        self.rows[slots] = rows
        self.positions[slots] = positions


class DSparkDrafter:
    name = "dspark"

    def __init__(self, model, draft: DSparkDraft):
        self.model, self.draft = model, draft
        self.window = model.config.window
        self.contexts: dict[int, tuple[object, _Context]] = {}  # id(request) -> (request, its context)
        model.feature_layers = draft.target_layers  # the target's forward keeps these layers' inputs

    def propose(self, requests: list, computed: list[ComputedRows]) -> list[Draft]:
        self._store(computed)
        for key in [k for k, (r, _) in self.contexts.items() if r.finished]:
            del self.contexts[key]
        if not requests:
            return []
        device = self.model.embed.weight.device
        contexts = [self._context(r, self.model.embed.weight) for r in requests]
        inputs = DraftInputs(
            anchors=torch.tensor([r.token_ids[-1] for r in requests], device=device),
            positions=torch.tensor([len(r.token_ids) - 1 for r in requests], device=device),
            context=torch.stack([c.rows for c in contexts]),
            context_positions=torch.stack([c.positions for c in contexts]),
        )
        heads = self.draft(inputs, self.model.embed, self.model.head)
        previous, tokens, confidences = inputs.anchors, [], []
        for position in range(self.draft.block_size):  # left to right: the Markov head reads the token before
            logits, confidence = self.draft.markov(previous, heads, position)
            previous = logits.argmax(dim=-1)
            tokens.append(previous)
            confidences.append(confidence)
        tokens, confidences = torch.stack(tokens, 1).tolist(), torch.stack(confidences, 1).tolist()
        return [Draft(t, c) for t, c in zip(tokens, confidences)]

    def _store(self, computed: list[ComputedRows]) -> None:
        """The kept rows of the last step into each request's context (projected once, all requests together)."""
        features = self.model.features
        if features is None:
            raise RuntimeError("DSpark drafting needs the target's features from every step, and the last step "
                               "produced none: the model's feature_layers were reset")
        # only the last ``window`` rows of each request can be read again (a long prefill computes many more)
        spans = [(c, max(0, c.count - self.window)) for c in computed]
        index = [torch.arange(c.row + skip, c.row + c.count) for c, skip in spans]
        if not index or not sum(len(i) for i in index):
            return
        projected = self.draft.project_context(features[torch.cat(index).to(features.device)])
        first = 0
        for c, skip in spans:
            count = c.count - skip
            positions = torch.arange(c.position + skip, c.position + c.count, device=projected.device)
            self._context(c.request, projected).write(positions, projected[first:first + count])
            first += count

    def _context(self, request, like: torch.Tensor) -> _Context:
        entry = self.contexts.get(id(request))
        if entry is None or entry[0] is not request:
            context = _Context(like.new_zeros(self.window, like.shape[-1]),
                               torch.full((self.window,), -1, dtype=torch.int64, device=like.device))
            entry = self.contexts[id(request)] = (request, context)
        return entry[1]
