"""DeepSeek-V4's classic multi-token prediction layer (checkpoint ``mtp.0.*``), as DeepSeek's reference
``MTPBlock`` computes it.

At position ``t`` it reads the target's final mHC streams there (before ``hc_head``) and the embedding of the token
at ``t + 1``, mixes them as ``e_proj(enorm(embed)) + h_proj(hnorm(streams))`` (per stream), runs one V4 block
(sliding-window attention over its own rows, a non-hash MoE) and predicts the token at ``t + 2`` through its own
``hc_head`` and ``norm`` and the target's vocabulary head. The block's output streams stand in for the target's at
``t + 1`` when it drafts again. Its window rows are keyed by position like the target's, so a rejected draft's row
is simply overwritten when that position is computed again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer.runtime.linear import Linear
from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig
from deepinfer.models.deepseek_v4.layers import RMSNorm, Rotary
from deepinfer.models.deepseek_v4.mhc import HyperHead
from deepinfer.models.deepseek_v4.model import Block


def mtp_config(c: DeepseekV4ModelConfig) -> DeepseekV4ModelConfig:
    """The target's config with one more layer: sliding-window only, no hash routing (layer id ``num_layers``)."""
    return dataclasses.replace(c, num_layers=c.num_layers + 1, compress_ratios=list(c.compress_ratios) + [0],
                               hash_layers=list(c.hash_layers) + [False])


class MTPLayer(Block):
    def __init__(self, config: DeepseekV4ModelConfig, rotary: Rotary, attention, moe, mhc):
        c = mtp_config(config)
        super().__init__(c, config.num_layers, rotary, attention, moe, mhc)
        hidden = c.hidden_size
        self.enorm = RMSNorm(hidden, c.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, c.rms_norm_eps)
        self.e_proj = Linear(hidden, hidden)
        self.h_proj = Linear(hidden, hidden)
        self.norm = RMSNorm(hidden, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, hidden, c.hc_eps, c.rms_norm_eps)

    def mix(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The block's input streams [N, hc, H] from the next tokens' embeddings [N, H] and the streams there."""
        projected = self.h_proj(self.hnorm(streams).flatten(0, 1)).view_as(streams)
        return projected + self.e_proj(self.enorm(embedded)).unsqueeze(1)

    def window_rows(self, streams: torch.Tensor, phases) -> torch.Tensor:
        """The attention rows [N, D] the block writes for input ``streams`` (what later positions attend to)."""
        x, _, _ = self.hc_attn.collapse(streams, self.attn_norm)
        return self.attn.keys(self.attn.wkv(x), phases)

    def forward(self, streams: torch.Tensor, phases, rows: torch.Tensor, index: torch.Tensor,
                store: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """The block over input ``streams`` [N, hc, H]: ``store`` puts its own window rows among ``rows`` [R, D],
        then each query reads the rows ``index`` [N, K] lists (-1: none)."""
        x, post, comb = self.hc_attn.collapse(streams, self.attn_norm)
        projected = self.attn.inputs(x)
        q, _ = self.attn.queries(projected["q"], phases)
        store(self.attn.keys(projected["kv"], phases))
        o = self.attn.backend.sparse_attention(q, [(rows, index)], self.attn.attn_sink, self.attn.scale)
        streams = self.hc_attn.expand(streams, self.attn.output(o, phases), post, comb)
        x, post, comb = self.hc_ffn.collapse(streams, self.ffn_norm)
        return self.hc_ffn.expand(streams, self.ffn(x, None), post, comb)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """What the target's vocabulary head reads."""
        return self.norm(self.hc_head(streams))
