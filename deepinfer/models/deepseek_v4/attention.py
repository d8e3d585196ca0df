"""DeepSeek-V4 attention: shared-KV MQA with sinks over a sliding window plus compressed entries.

Sliding layers (ratio 0) see the last ``window`` raw rows. Compressed layers add entries pooled
from ``ratio`` tokens each: HCA layers see all closed entries, CSA layers the lightning
indexer's top-k. Every step first writes its own rows to the paged caches, then reads them
back through slot indices, so prefill, chunked prefill and decode share one code path.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.runner.forward_batch import CompressedMeta, ForwardBatch
from deepinfer.runtime.linear import Linear, SharedInput
from deepinfer.runtime.ops import grouped_product
from deepinfer.models.deepseek_v4.layers import RMSNorm, Rotary
from deepinfer.plugins.interfaces import AttentionBackend


def _linear(rows: int, cols: int) -> nn.Linear:
    """A projection the checkpoints always ship in bf16/fp32."""
    return nn.Linear(cols, rows, bias=False)


def grouped_output(o: torch.Tensor, wo_a: Linear, wo_b: Linear, groups: int) -> torch.Tensor:
    """Output projection: each group of heads [T, H/g * D] has its own low-rank ``wo_a`` block, then ``wo_b``.

    DeepSeek's own converter dequantizes ``wo_a`` when it loads; an FP8 ``wo_a`` is kept as shipped (half the bytes a
    decode step reads) and multiplied as that copy would be, its activations unrounded (``grouped_linear``).
    """
    grouped = o.reshape(o.shape[0], groups, -1)
    if wo_a.scale is not None:
        mixed = wo_a.backend.grouped_linear(grouped, wo_a.weight, wo_a.scale)
    else:
        mixed = grouped_product(grouped, wo_a.weight)
    return wo_b(mixed.flatten(1))


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry by a per-channel softmax over gated scores.

    With ``overlap`` 2 (CSA) each token projects to two series: the first half feeds the next
    window's entry, the second half the current one, so an entry spans ``2*ratio`` tokens.
    """

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: int, eps: float):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = _linear(overlap * dim, hidden)
        self.wgate = _linear(overlap * dim, hidden)
        self.ape = nn.Parameter(torch.zeros(ratio, overlap * dim, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(dim, eps)

    def pool(self, state: torch.Tensor, meta: CompressedMeta, backend: AttentionBackend) -> torch.Tensor:
        """Entries [n, dim] (normed, before RoPE, fp32) for the windows closing in this step."""
        return backend.compress_pool(state, meta.close_rows, self.ratio, self.overlap, self.norm.weight, self.norm.eps)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed index keys per query and keeps the top-k."""

    def __init__(self, config, rotary: Rotary):
        super().__init__()
        self.n_heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.rotary = rotary
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.dim)
        self.weights_proj = _linear(self.n_heads, config.hidden_size)
        self.compressor = Compressor(config.hidden_size, self.dim, config.csa_ratio, 2, config.rms_norm_eps)
        self.weight_scale = self.dim**-0.5 * self.n_heads**-0.5

    def forward(self, weights, qr, phases, keys, meta: CompressedMeta, backend: AttentionBackend) -> torch.Tensor:
        """The top-k entries per query from ``weights`` (``weights_proj``'s output) and the low-rank query rows."""
        if meta.candidates.shape[1] <= self.topk and not getattr(backend, "batch_invariant", False):
            # every visible entry is picked: nothing to score. Listed in candidate order rather than by score, which
            # only changes the order attention sums them in; batch-invariant mode scores anyway, since whether a
            # request's candidates fit depends on how wide its batch made them
            return meta.candidates
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.dim)
        q = self.rotary.apply(q, phases)
        return backend.indexer_topk(q, weights.float() * self.weight_scale, keys, meta.candidates, self.topk)


class Attention(nn.Module):
    def __init__(self, config, layer_id: int, rotary: Rotary, backend: AttentionBackend):
        super().__init__()
        c = config
        self.layer_id, self.backend, self.rotary = layer_id, backend, rotary
        self.n_heads, self.head_dim, self.o_groups = c.num_heads, c.head_dim, c.o_groups
        self.eps = c.rms_norm_eps
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
        self.compressor = self.indexer = None
        if self.ratio:
            overlap = 2 if self.ratio == c.csa_ratio else 1
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, overlap, c.rms_norm_eps)
            if self.ratio == c.csa_ratio:
                self.indexer = Indexer(c, rotary)
        # everything that reads the layer's input, as one GEMM per weight format once loaded
        projections = {"q": self.wq_a, "kv": self.wkv}
        if self.compressor is not None:
            projections.update({"compressor.kv": self.compressor.wkv, "compressor.gate": self.compressor.wgate})
        if self.indexer is not None:
            projections.update({"index.kv": self.indexer.compressor.wkv, "index.gate": self.indexer.compressor.wgate,
                                "index.weights": self.indexer.weights_proj})
        self.inputs = SharedInput(projections)

    def _compress(self, compressor: Compressor, kv, score, batch: ForwardBatch, meta: CompressedMeta, state,
                  entries) -> None:
        """``kv`` and ``score``: the compressor's projections of the layer input."""
        # every token's state row, the position bias folded into its score (``AttentionBackend.store_compressor_rows``)
        self.backend.store_compressor_rows(state, meta.state_slots, batch.gather(kv), batch.gather(score),
                                           compressor.ape, batch.gather(batch.positions))
        if meta.close_slots.numel():
            pooled = compressor.pool(state, meta, self.backend)
            pooled = self.rotary.apply(pooled, meta.close_phases)
            self.backend.store_rows(entries, meta.close_slots, pooled)

    def queries(self, q_lora: torch.Tensor, phases) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated per-head queries [T, H, D] and the low-rank query rows the indexer reads, from ``wq_a``'s
        output."""
        qr = self.q_norm(q_lora)
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        return self.rotary.apply(self.backend.rms_norm(q, None, self.eps), phases), qr

    def keys(self, kv: torch.Tensor, phases) -> torch.Tensor:
        """The window rows [T, D] (keys and values at once) from ``wkv``'s output."""
        return self.rotary.apply(self.kv_norm(kv), phases)

    def output(self, o: torch.Tensor, phases) -> torch.Tensor:
        return grouped_output(self.rotary.apply(o, phases, inverse=True), self.wo_a, self.wo_b, self.o_groups)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, phases, caches) -> torch.Tensor:
        projected = self.inputs(x)
        q, qr = self.queries(projected["q"], phases)
        kv = self.keys(projected["kv"], phases)

        raw = caches.pool("swa", "kv", self.layer_id)
        self.backend.store_rows(raw, batch.swa_slots, batch.gather(kv))
        sources = [(raw, batch.window)]
        if self.ratio:
            meta = batch.compressed[self.ratio]
            entries_kind, state_kind = f"comp{self.ratio}", f"state{self.ratio}"
            entries = caches.pool(entries_kind, "kv", self.layer_id)
            state = caches.pool(state_kind, "kv", self.layer_id)
            self._compress(self.compressor, projected["compressor.kv"], projected["compressor.gate"], batch, meta,
                           state, entries)
            if self.indexer is None:
                sources.append((entries, meta.candidates))
            else:
                keys = caches.pool(entries_kind, "index", self.layer_id)
                key_state = caches.pool(state_kind, "index", self.layer_id)
                self._compress(self.indexer.compressor, projected["index.kv"], projected["index.gate"], batch, meta,
                               key_state, keys)
                sources.append((entries, self.indexer(projected["index.weights"], qr, phases, keys, meta,
                                                      self.backend)))

        return self.output(self.backend.sparse_attention(q, sources, self.attn_sink, self.scale), phases)
