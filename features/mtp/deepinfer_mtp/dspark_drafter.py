"""Drafting with DSpark: each request keeps the draft's context (its last ``window`` projected target features),
and after every step one draft pass proposes a block of tokens for every request that decodes next.

The contexts live in one device pool, a slot per request (``ContextPool``), so a draft pass reads them by slot
index: its inputs are three integers per request, and where the engine replays CUDA graphs the whole pass (the
stages, the Markov loop, the confidences) replays as one graph per batch size (``DraftGraphs``).
"""

from __future__ import annotations

import torch

from deepinfer.models.contract import DraftContext
from deepinfer.models.deepseek_v41.dspark import DraftInputs, DSparkDraft
from deepinfer.plugins.interfaces import ComputedRows
from deepinfer_mtp.context_pool import ContextPool
from deepinfer_mtp.pooled_drafter import PooledDrafter


class DSparkDrafter(PooledDrafter):
    name = "dspark"

    def __init__(self, context: DraftContext, draft: DSparkDraft, max_requests: int,
                 vocabulary: torch.Tensor | None = None):
        """``vocabulary``: the sorted token ids drafts are drawn from (``EngineConfig.draft_vocab``), None for all:
        the pass then reads the vocabulary head's rows of those tokens alone, kept here as a copy."""
        self.context, self.draft = context, draft
        self.device = context.device
        first = draft.layers[0].main_proj.weight
        self.pool = ContextPool(max_requests, context.config.window, context.config.hidden_size, first.dtype,
                                self.device)
        self.project_vocab = context.project_vocab
        if vocabulary is not None:
            vocabulary = vocabulary.to(self.device)
            rows, logits = context.vocab_head.detach()[vocabulary], context.backends.linear.logits
            self.project_vocab = lambda hidden: logits(hidden, rows)
            draft.restrict_vocabulary(vocabulary)

    @property
    def vocabulary(self) -> torch.Tensor | None:
        """The token ids drafts are drawn from (the draft's), None for the whole vocabulary."""
        return self.draft.vocabulary

    def _draft(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and confidences [B, block] for ``inputs`` [3, B] (anchor ids, their positions, context slots);
        no host synchronisation, so a graph can hold it."""
        anchors, positions, slots = inputs
        draft, target = self.draft, self.context
        heads = draft(DraftInputs(anchors, positions, self.pool.rows[slots], self.pool.positions[slots]), target.embed)
        projected = draft.block_logits(heads, self.project_vocab)
        previous, tokens, confidences = anchors, [], []
        for position in range(draft.block_size):  # left to right: the Markov head reads the token before
            logits, confidence = draft.markov(previous, heads, position, projected(position))
            previous = logits.argmax(dim=-1)
            if draft.vocabulary is not None:  # a position in the draft vocabulary to its token id
                previous = draft.vocabulary[previous]
            tokens.append(previous)
            confidences.append(confidence)
        return torch.stack(tokens, 1), torch.stack(confidences, 1)

    def _store(self, computed: list[ComputedRows], features: torch.Tensor | None) -> None:
        """The kept rows of the last step into each request's context (projected once, all requests together)."""
        if features is None:
            raise RuntimeError("DSpark drafting needs the target's features from every step, and the last step "
                               "produced none: the model was built without keep_features")
        # only the last ``window`` rows of each request can be read again (a long prefill computes many more)
        window = self.pool.window
        rows, positions, slots = [], [], []
        for c in computed:
            skip = max(0, c.count - window)
            rows.append(torch.arange(c.row + skip, c.row + c.count))
            positions.append(torch.arange(c.position + skip, c.position + c.count))
            slots.append(torch.full((c.count - skip,), self.pool.slot(c.request)))
        if not rows or not sum(len(r) for r in rows):
            return
        index = torch.stack([torch.cat(rows), torch.cat(positions), torch.cat(slots)]).to(self.device)
        self._write(features, index[0], index[1], index[2], None, None, None)

    def _write(self, features, rows, positions, slots, next_tokens, last_slots, last_rows) -> None:
        self.pool.write(slots, positions, self.draft.project_context(features[rows]))
