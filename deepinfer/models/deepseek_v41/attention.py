"""CSA2: V4.1's attention. Every layer attends to its own sliding window plus, when compressed, shared entries.

Roles, fixed by the config:

* **KV source** layers own a compressor. With ratio 2 it pools each pair of tokens by a per-channel softmax;
  with ratio 1 every token is its own entry. The entry (NVFP4-rounded, after RoPE) and its index key
  (MXFP4-rounded ``k_norm(wk(latent))``) go to the source's compressed cache.
* Other compressed layers read the cache of the latest source at or below them.
* **Index source** layers score the visible entries with their own queries and pick the top-k. Layers that are
  not index sources reuse the latest pick.
* The **candidate source** (two-level indexer) also publishes, per query, its best ``candidate_topk_blocks``
  blocks of ``candidate_block_size`` entries (the latest block always included). Index layers after it score
  only inside those blocks.

Window KV is FP8-rounded before it is cached. The selection and candidates live for one forward pass only: they
depend on the step's queries, not on cached state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.runner.forward_batch import CompressedMeta, ForwardBatch
from deepinfer.runtime.linear import Linear, SharedInput
from deepinfer.models.deepseek_v4.attention import grouped_output
from deepinfer.models.deepseek_v4.layers import RMSNorm
from deepinfer.models.deepseek_v41.layers import ComplexRotary
from deepinfer.runtime.ops import descending_order, select_topk
from deepinfer.plugins.interfaces import AttentionBackend


def _linear(rows: int, cols: int, dtype=None) -> nn.Linear:
    """A projection the release always ships in bf16/fp32."""
    return nn.Linear(cols, rows, bias=False, dtype=dtype)


@dataclass(slots=True)
class Selection:
    """What index layers hand to later layers within one forward pass."""

    slots: torch.Tensor | None = None  # [T, k] compressed-cache slots each token attends to, -1 padded
    candidates: torch.Tensor | None = None  # [T, C] bool over the visible entries, from the candidate source


class Compressor(nn.Module):
    """A KV source's compressor: latent entries (normed, before RoPE) from ``ratio`` tokens each."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        self.wkv = _linear(dim, hidden, torch.float32)
        self.wgate = _linear(dim, hidden, torch.float32) if ratio > 1 else None
        self.norm = RMSNorm(dim, eps)

    def state_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token ``[kv | score]`` rows in fp32, waiting for their group to close."""
        xf = x.float()
        return torch.cat([F.linear(xf, self.wkv.weight), F.linear(xf, self.wgate.weight)], dim=-1)

    def latents(self, x: torch.Tensor, state: torch.Tensor | None, meta: CompressedMeta) -> torch.Tensor:
        """Entries [n, dim] for the groups closing in this step, in ``meta.close_slots`` order."""
        if self.ratio == 1:  # every token closes its own group, in token order
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))
        gathered = state[meta.close_rows]  # groups never start before position 0, so no row is -1
        kv, score = gathered.chunk(2, dim=-1)
        return self.norm((kv * score.softmax(dim=1)).sum(dim=1).to(x.dtype))


class Indexer(nn.Module):
    def __init__(self, config, layer_id: int, owns_keys: bool):
        super().__init__()
        c = config
        self.n_heads, self.dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.is_candidate_source = layer_id == c.candidate_source_layer_id
        self.uses_candidates = c.uses_candidates(layer_id)
        self.block_size, self.top_blocks = c.candidate_block_size, c.candidate_topk_blocks
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.dim)
        self.weights_proj = _linear(self.n_heads, c.hidden_size)
        if owns_keys:
            self.wk = _linear(self.dim, c.head_dim)
            self.k_norm = RMSNorm(self.dim, c.rms_norm_eps)

    def keys(self, latent: torch.Tensor, rotary: ComplexRotary, phases: torch.Tensor) -> torch.Tensor:
        return rotary.backend.round_to_format(rotary.apply(self.k_norm(self.wk(latent)), phases), "mxfp4")

    def forward(self, x, qr, rotary: ComplexRotary, phases, keys, meta: CompressedMeta, positions,
                selection: Selection, backend: AttentionBackend) -> torch.Tensor:
        q = rotary.apply(self.wq_b(qr).view(x.shape[0], self.n_heads, self.dim), phases)
        q = backend.round_to_format(q, "mxfp4")
        weights = self.weights_proj(x) * (self.dim**-0.5 * self.n_heads**-0.5)
        scores = backend.indexer_scores(q, weights, keys, meta.candidates)  # [T, C], -inf where not visible
        if self.is_candidate_source:
            selection.candidates = self._best_blocks(scores, (positions + 1) // meta.ratio) & (meta.candidates >= 0)
        elif self.uses_candidates:
            scores = scores.masked_fill(~selection.candidates, float("-inf"))
        return select_topk(scores, meta.candidates, self.topk)

    def _best_blocks(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[T, C] bool: entries in each query's best blocks (by their best entry); its latest block always."""
        num_tokens, width = scores.shape
        blocks = F.pad(scores, (0, -width % self.block_size), value=float("-inf"))
        blocks = blocks.view(num_tokens, -1, self.block_size).amax(dim=-1)
        latest = (visible - 1) // self.block_size
        blocks = blocks.masked_fill(torch.arange(blocks.shape[1], device=scores.device) == latest.unsqueeze(1), float("inf"))
        values, order = descending_order(blocks)  # tied blocks: the earlier wins, as entries do
        keep = min(self.top_blocks, blocks.shape[1])
        chosen = torch.zeros_like(blocks, dtype=torch.bool).scatter(1, order[:, :keep], values[:, :keep] > float("-inf"))
        return chosen.repeat_interleave(self.block_size, dim=1)[:, :width]


class Attention(nn.Module):
    def __init__(self, config, layer_id: int, rotary: ComplexRotary, backend: AttentionBackend):
        super().__init__()
        c = config
        self.layer_id, self.rotary, self.backend = layer_id, rotary, backend
        self.n_heads, self.head_dim, self.o_groups = c.num_heads, c.head_dim, c.o_groups
        self.ratio = c.compress_ratios[layer_id]
        self.scale = self.head_dim**-0.5
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, backend)
        self.wq_b = Linear(c.q_lora_rank, c.num_heads * c.head_dim)
        self.wkv = Linear(c.hidden_size, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, backend)
        self.wo_a = Linear(c.num_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(c.num_heads, dtype=torch.float32), requires_grad=False)
        self.source = c.kv_source(layer_id) if self.ratio else None
        owns = self.ratio > 0 and self.source == layer_id
        self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, c.rms_norm_eps) if owns else None
        self.indexer = Indexer(c, layer_id, owns) if layer_id in c.index_source_layer_ids else None
        self.inputs = SharedInput({"q": self.wq_a, "kv": self.wkv})  # one FP8 GEMM once loaded

    def _compress(self, x, batch: ForwardBatch, meta: CompressedMeta, caches) -> None:
        kind = f"comp{self.ratio}"
        state = None
        if self.ratio > 1:
            state = caches.pool(f"state{self.ratio}", "kv", self.layer_id)
            state.index_copy_(0, meta.state_slots, batch.gather(self.compressor.state_rows(x)))
        if not meta.close_slots.numel():
            return
        # ratio 1: every token is an entry, made from its own row (gathered); ratio 2: pooled from the state
        latent = batch.gather(self.compressor.latents(x, None, meta)) if state is None else \
            self.compressor.latents(x, state, meta)
        phases = meta.close_phases
        entries = caches.pool(kind, "kv", self.layer_id)
        rounded = self.backend.round_to_format(self.rotary.apply(latent, phases), "nvfp4")
        entries.index_copy_(0, meta.close_slots, rounded.to(entries.dtype))
        keys = caches.pool(kind, "index", self.layer_id)
        keys.index_copy_(0, meta.close_slots, self.indexer.keys(latent, self.rotary, phases).to(keys.dtype))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, phases, caches, selection: Selection) -> torch.Tensor:
        num_tokens = x.shape[0]
        projected = self.inputs(x)
        qr = self.q_norm(projected["q"])
        q = self.rotary.apply(self.wq_b(qr).view(num_tokens, self.n_heads, self.head_dim), phases)
        kv = self.backend.round_to_format(self.rotary.apply(self.kv_norm(projected["kv"]), phases), "fp8")
        raw = caches.pool("swa", "kv", self.layer_id)
        raw.index_copy_(0, batch.swa_slots, batch.gather(kv).to(raw.dtype))
        sources = [(raw, batch.window)]
        if self.ratio:
            meta = batch.compressed[self.ratio]
            if self.compressor is not None:
                self._compress(x, batch, meta, caches)
            if self.indexer is not None:
                keys = caches.pool(f"comp{self.ratio}", "index", self.source)
                selection.slots = self.indexer(x, qr, self.rotary, phases, keys, meta, batch.positions, selection,
                                               self.backend)
            sources.append((caches.pool(f"comp{self.ratio}", "kv", self.source), selection.slots))
        o = self.backend.sparse_attention(q, sources, self.attn_sink, self.scale)
        o = self.rotary.apply(o, phases, inverse=True)
        return grouped_output(o, self.wo_a, self.wo_b, self.o_groups)
