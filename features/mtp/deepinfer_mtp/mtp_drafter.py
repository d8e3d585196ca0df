"""Drafting with DeepSeek-V4's classic MTP layer: after every step, the layer's window rows for the positions the
target computed (``ContextPool``, one slot per request), then a chain of ``num_drafts`` passes per decoding
request, each feeding the layer its own output streams and the token it just drafted (as vLLM and SGLang reuse
the one layer for longer drafts). The chain replays from CUDA graphs where the engine's decode steps do."""

from __future__ import annotations

import torch

from deepinfer.models.contract import DraftContext
from deepinfer.models.deepseek_v4.mtp import MTPLayer
from deepinfer.plugins.interfaces import ComputedRows
from deepinfer_mtp.context_pool import ContextPool
from deepinfer_mtp.pooled_drafter import PooledDrafter


class MTPDrafter(PooledDrafter):
    name = "mtp"
    anchor_back = 2  # the chain starts at the position before the last token: the target's streams there

    def __init__(self, context: DraftContext, layer: MTPLayer, max_requests: int, num_drafts: int):
        self.context, self.layer, self.num_drafts = context, layer, num_drafts
        c = context.config
        self.device = context.device
        # the chain writes rows up to num_drafts - 1 positions past the anchor, while the anchor's window is kept
        self.pool = ContextPool(max_requests, c.window, c.head_dim, context.dtype, self.device, lookahead=num_drafts)
        # per slot: the target's final streams at the last position it computed (the chain's first input)
        self.streams = torch.zeros(max_requests + 1, c.hc_mult, c.hidden_size, dtype=context.dtype,
                                   device=self.device)

    def _draft(self, inputs: torch.Tensor) -> tuple[torch.Tensor]:
        """Draft tokens [B, num_drafts] for ``inputs`` [3, B] (the tokens after each chain's first position, that
        position, the slot); no host synchronisation, so a graph can hold it."""
        tokens, positions, slots = inputs
        layer, target, pool = self.layer, self.context, self.pool
        streams = self.streams[slots]
        rows = pool.rows.flatten(0, 1)
        drafts = []
        for step in range(self.num_drafts):
            at = positions + step
            index = pool.visible(slots, at, own_row=True)
            phases = target.rotary.phases(at)
            mixed = layer.mix(target.embed(tokens), streams)
            streams = layer(mixed, phases, rows, index, lambda kv, at=at: pool.write(slots, at, kv))
            tokens = target.project_vocab(layer.final_hidden(streams)).argmax(dim=-1)
            drafts.append(tokens)
        return (torch.stack(drafts, 1),)

    def _store(self, computed: list[ComputedRows], features: torch.Tensor | None) -> None:
        """The layer's window rows for the last ``window`` positions each request computed in the last step (the
        ones later positions attend to), and the target's streams at its last one."""
        if features is None:
            raise RuntimeError("MTP drafting needs the target's final streams from every step, and the last step "
                               "produced none: the model was built without keep_features")
        window, rows, positions, next_tokens, slots, last = self.pool.window, [], [], [], [], []
        for c in computed:
            # a row at position p pairs with the token at p + 1, which every computed row but a pending one has
            count = min(c.count, len(c.request.token_ids) - 1 - c.position)
            skip = max(0, count - window)
            if count - skip <= 0:
                continue
            slot = self.pool.slot(c.request)
            rows.append(torch.arange(c.row + skip, c.row + count))
            positions.append(torch.arange(c.position + skip, c.position + count))
            next_tokens.append(torch.tensor(c.request.token_ids[c.position + skip + 1:c.position + count + 1]))
            slots.append(torch.full((count - skip,), slot))
            last.append((slot, c.row + count - 1))
        if not rows:
            return
        index = torch.stack([torch.cat(rows), torch.cat(positions), torch.cat(next_tokens), torch.cat(slots)])
        index = index.to(self.device)
        last = torch.tensor(last).to(self.device)
        self._write(features, index[0], index[1], index[3], index[2], last[:, 0], last[:, 1])

    def _write(self, features, rows, positions, slots, next_tokens, last_slots, last_rows) -> None:
        streams = features[rows].view(len(rows), *self.streams.shape[1:])
        mixed = self.layer.mix(self.context.embed(next_tokens), streams)
        self.pool.write(slots, positions, self.layer.window_rows(mixed, self.context.rotary.phases(positions)))
        self.streams[last_slots] = features[last_rows].view(len(last_rows), *self.streams.shape[1:])
