"""DeepSeek-V4.1's DSpark draft (checkpoint ``mtp.{0,1,2}.*``): proposes a block of tokens in one pass.

For a request whose last token (the *anchor*) sits at position ``a``, the block's inputs are the anchor's embedding
and ``block_size - 1`` embeddings of the noise token, at positions ``a .. a + block_size - 1``; the outputs there
predict the tokens at ``a + 1 .. a + block_size``. Each stage is a window-only V4.1 block (mHC, attention with
sinks, a small MoE) whose queries see the block itself (non-causally) and the *context*: the target model's
features at the ``window`` positions before ``a``. Those features are, per target layer in
``dspark_target_layer_ids``, the mean over the mHC streams of that layer's input (after Engram), concatenated and
projected once by stage 0's ``main_proj`` and ``main_norm`` (``context``); every stage derives its context keys
from them with its own ``wkv``, ``kv_norm`` and RoPE, FP8-rounded like window KV.

The last stage adds two heads. The Markov head biases each position's logits by a rank-r function of the token
before it, so tokens are picked left to right from one backbone pass; the confidence head estimates the chance
that each drafted token is accepted given the ones before it (it reads the final norm's output and the Markov
embedding, as NeMo AutoModel trains it). Numerics follow NeMo AutoModel's ``DeepseekV41DSparkModel``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.deepseek_v4.attention import grouped_output
from deepinfer.models.deepseek_v4.layers import RMSNorm
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v41.attention import Attention
from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
from deepinfer.models.deepseek_v41.layers import ComplexRotary, MixPredictor


# Rows (requests x block positions) up to which a draft pass projects all its positions in one call: the fp32
# logits are then [rows, vocab] (132 MB at 256 rows and V4.1's vocabulary)
ONE_PROJECTION_MAX_ROWS = 256


@dataclasses.dataclass(slots=True)
class DraftInputs:
    """One block per request: ``anchors`` [B] token ids at ``positions`` [B]; ``context`` [B, W, hidden] projected
    features at ``context_positions`` [B, W] (-1 where a slot holds nothing the anchor may see)."""

    anchors: torch.Tensor
    positions: torch.Tensor
    context: torch.Tensor
    context_positions: torch.Tensor


@dataclasses.dataclass(slots=True)
class DraftHeads:
    """The last stage's output for every block position, before any token's Markov bias."""

    normalized: torch.Tensor  # [B, D, hidden] fp32: what the vocabulary head and the confidence head read


class DSparkStage(nn.Module):
    def __init__(self, config: DeepseekV41ModelConfig, stage: int, rotary: ComplexRotary, attention, moe, mhc):
        super().__init__()
        c, hidden = draft_config(config), config.hidden_size
        self.attn_norm = RMSNorm(hidden, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(hidden, c.rms_norm_eps)
        self.hc_attn = MixPredictor(c.hc_mult, hidden, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.hc_ffn = MixPredictor(c.hc_mult, hidden, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.attn = Attention(c, c.num_layers + stage, rotary, attention)  # window-only: its projections and sinks
        self.ffn = MoE(c, False, moe)
        self.ffn.gate.register_buffer("bias_vl", torch.zeros(self.ffn.gate.bias.shape, dtype=torch.float32))
        self.mhc = mhc
        if stage == 0:
            targets = len(c.dspark["dspark_target_layer_ids"])
            self.main_proj = nn.Linear(targets * hidden, hidden, bias=False)
            self.main_norm = RMSNorm(hidden, c.rms_norm_eps)
        if stage == c.num_nextn_predict_layers - 1:
            rank = int(c.dspark["dspark_markov_rank"])
            self.norm = RMSNorm(hidden, c.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(c.vocab_size, rank)
            self.markov_head.head = nn.Linear(rank, c.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(hidden + rank, 1, bias=False)

    def forward(self, streams, pre, context_kv, index, phases):
        x, attn_pre, post, comb = self.hc_attn.enter(streams, pre, self.attn_norm)
        streams = self.mhc.expand(streams, self._attend(x, context_kv, index, phases), post, comb)
        x, ffn_pre, post, comb = self.hc_ffn.enter(streams, attn_pre, self.ffn_norm)
        return self.mhc.expand(streams, self.ffn(x, None), post, comb), ffn_pre

    def keys(self, x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
        """Attention rows of ``x`` (context rows or the block's own), FP8-rounded like window KV."""
        a = self.attn
        return a.backend.round_to_format(a.rotary.apply(a.kv_norm(a.wkv(x)), phases), "fp8")

    def _attend(self, x, context_kv, index, phases):
        """Queries of every block position over [context rows | the block's own rows] (``index`` into both)."""
        a = self.attn
        q = a.rotary.apply(a.wq_b(a.q_norm(a.wq_a(x))).view(x.shape[0], a.n_heads, a.head_dim), phases)
        rows = torch.cat([context_kv, self.keys(x, phases)])
        o = a.backend.sparse_attention(q, [(rows, index)], a.attn_sink, a.scale)
        return grouped_output(a.rotary.apply(o, phases, inverse=True), a.wo_a, a.wo_b, a.o_groups)


def draft_config(c: DeepseekV41ModelConfig) -> DeepseekV41ModelConfig:
    """The target's config with the draft's MoE sizes (its own expert count and top-k) and window-only layers
    numbered after the target's."""
    return dataclasses.replace(c, n_routed_experts=int(c.dspark["dspark_n_routed_experts"]),
                               num_experts_per_tok=int(c.dspark["dspark_num_experts_per_tok"]),
                               compress_ratios=list(c.compress_ratios) + [0] * c.num_nextn_predict_layers)


class DSparkDraft(nn.Module):
    """The draft stages as ``layers`` (checkpoint ``mtp.{i}.*`` is read as ``layers.{i}.*``); the embedding and the
    vocabulary head are the target model's."""

    def __init__(self, config: DeepseekV41ModelConfig, rotary: ComplexRotary, attention, moe, mhc):
        super().__init__()
        c = config
        self.config = c
        self.block_size = int(c.dspark["dspark_block_size"])
        self.noise_token_id = int(c.dspark["dspark_noise_token_id"])
        self.target_layers = tuple(int(i) for i in c.dspark["dspark_target_layer_ids"])
        self.rotary, self.mhc = rotary, mhc
        self.layers = nn.ModuleList(DSparkStage(c, s, rotary, attention, moe, mhc)
                                    for s in range(c.num_nextn_predict_layers))
        # the token ids drafts are drawn from (``restrict_vocabulary``), sorted; None: the whole vocabulary
        self.vocabulary: torch.Tensor | None = None

    def restrict_vocabulary(self, ids: torch.Tensor) -> None:
        """Draft only the tokens ``ids`` [K] (sorted, on the draft's device): ``markov`` then returns logits over
        them, position ``i`` standing for token ``ids[i]``, and the caller's ``block_logits`` projection must
        cover the same rows (``loading/draft_vocab.py``)."""
        self.vocabulary = ids
        self.__dict__.pop("_markov_fp32", None)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [N, targets * hidden] -> the context rows every stage attends to [N, hidden]."""
        first = self.layers[0]
        return first.main_norm(first.main_proj(features.to(first.main_proj.weight.dtype)))

    def forward(self, inputs: DraftInputs, embed: nn.Embedding) -> DraftHeads:
        batch, width = inputs.context_positions.shape
        d = self.block_size
        device = inputs.anchors.device
        tokens = torch.full((batch, d), self.noise_token_id, dtype=torch.int64, device=device)
        tokens[:, 0] = inputs.anchors
        x = embed(tokens.flatten())
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], self.config.hc_mult, dtype=torch.float32, device=device)
        pre[:, 0] = 1
        positions = (inputs.positions.unsqueeze(1) + torch.arange(d, device=device)).flatten()
        phases = self.rotary.phases(positions)
        context_positions = inputs.context_positions.flatten()
        context_phases = self.rotary.phases(context_positions.clamp_min(0))
        context = inputs.context.flatten(0, 1)
        index = self._index(inputs, batch, width, d)
        for stage in self.layers:
            streams, pre = stage(streams, pre, stage.keys(context, context_phases), index, phases)
        last = self.layers[-1]
        return DraftHeads(last.norm(self.mhc.collapse(streams, pre)).float().view(batch, d, -1))

    def _index(self, inputs: DraftInputs, batch: int, width: int, d: int) -> torch.Tensor:
        """[B * D, W + D] rows each query reads: its request's visible context rows, then its block's rows."""
        device = inputs.anchors.device
        visible = (inputs.context_positions >= 0) & (inputs.context_positions < inputs.positions.unsqueeze(1)) & (
            inputs.context_positions >= inputs.positions.unsqueeze(1) - self.config.window)
        context_rows = torch.arange(batch * width, device=device).view(batch, width)
        context_rows = torch.where(visible, context_rows, -1)
        block_rows = batch * width + torch.arange(batch * d, device=device).view(batch, d)
        per_request = torch.cat([context_rows, block_rows], dim=1)  # [B, W + D]
        return per_request.unsqueeze(1).expand(-1, d, -1).reshape(batch * d, -1)

    def _markov_weight(self) -> torch.Tensor:
        """The Markov head's weight in fp32 (its draft vocabulary's rows, where restricted), made on the first
        draft (the weights are loaded by then) rather than on every call (a [vocab, rank] copy each position of
        each pass otherwise: 132 MB written at V4.1-Flash's sizes, inside every replayed draft graph)."""
        weight = self.layers[-1].markov_head.head.weight
        if weight.dtype == torch.float32 and self.vocabulary is None:
            return weight
        cached = self.__dict__.get("_markov_fp32")
        if cached is None or cached[0] != weight.data_ptr():
            rows = weight.detach() if self.vocabulary is None else weight.detach()[self.vocabulary]
            cached = self.__dict__["_markov_fp32"] = (weight.data_ptr(), rows.float())
        return cached[1]

    def block_logits(self, heads: DraftHeads, project_vocab: Callable[[torch.Tensor], torch.Tensor]
                     ) -> Callable[[int], torch.Tensor]:
        """``position -> [B, vocab]``: the target's fp32 vocabulary projection (``project_vocab``) of each block
        position's backbone output, before the Markov bias. Up to ``ONE_PROJECTION_MAX_ROWS`` rows every position
        is projected in one call, so the head's weights are read once a pass instead of once a position (at batch
        1 each read is V4.1-Flash's 1.3 GB); beyond, one position at a time, with no [B, block, vocab] buffer."""
        normalized = heads.normalized
        batch, block = normalized.shape[:2]
        if batch * block > ONE_PROJECTION_MAX_ROWS:
            return lambda position: project_vocab(normalized[:, position])
        projected = project_vocab(normalized.flatten(0, 1)).view(batch, block, -1)
        return lambda position: projected[:, position]

    def markov(self, previous: torch.Tensor, heads: DraftHeads, position: int, projected: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, vocab] (over the draft vocabulary, where restricted) and acceptance confidence [B] at block
        ``position``, given the token before it; ``projected``: the position's vocabulary projection
        (``block_logits``)."""
        last = self.layers[-1]
        normalized = heads.normalized[:, position]
        embedding = last.markov_head.embed(previous)
        logits = projected + F.linear(embedding.float(), self._markov_weight())
        features = torch.cat([normalized, embedding.float()], dim=-1)
        confidence = torch.sigmoid(F.linear(features, last.confidence_head.proj.weight.float())).squeeze(-1)
        return logits, confidence
