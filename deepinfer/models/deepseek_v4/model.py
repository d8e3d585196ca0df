"""DeepSeek-V4 (V4-Flash, V4-Pro, V4-Flash-0731) on DeepInfer's paged caches."""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.runner.forward_batch import ForwardBatch
from deepinfer.runtime.kv_cache import CacheKind, KVCache, Pool, compressor_state_kind, sliding_kind
from deepinfer.runtime.linear import cast_floating
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig, inv_freq
from deepinfer.models.deepseek_v4.layers import RMSNorm, Rotary
from deepinfer.models.deepseek_v4.mhc import HyperConnection, HyperHead
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.contract import Backends, ModelOutput
from deepinfer.plugins.interfaces import AttentionBackend, MHCBackend, MoEBackend

# Tensors that stay fp32 whatever the model dtype: as the checkpoints ship them, and the router's weight, which it
# multiplies in fp32 (kept so, it is not widened again in every step)
_FP32_SUFFIXES = ("norm.weight", "attn_sink", "ape", "gate.bias", ".gate.weight")
# Our module paths -> DeepSeek's tensor names for the hyper-connection parameters.
_HC_NAMES = re.compile(r"(hc_attn|hc_ffn|hc_head)\.(fn|base|scale)$")


def keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES) or _HC_NAMES.search(name) is not None


class Block(nn.Module):
    def __init__(self, config: DeepseekV4ModelConfig, layer_id: int, rotary: Rotary, attention: AttentionBackend,
                 moe: MoEBackend, mhc: MHCBackend):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_attn = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.hc_ffn = HyperConnection(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.attn = Attention(c, layer_id, rotary, attention)
        self.ffn = MoE(c, c.hash_layers[layer_id], moe)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, phases, caches: KVCache) -> torch.Tensor:
        x, post, comb = self.hc_attn.collapse(streams, self.attn_norm)
        streams = self.hc_attn.expand(streams, self.attn(x, batch, phases, caches), post, comb)
        x, post, comb = self.hc_ffn.collapse(streams, self.ffn_norm)
        return self.hc_ffn.expand(streams, self.ffn(x, batch.token_ids), post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    token_history = 0  # no layer looks at earlier token ids
    needs_host_tokens = False
    graph_blocker = None  # nothing in the forward pass waits on the host
    decoder_start = None  # every layer keeps full-context state: no window-only decoder layers to replay
    host_inputs = None  # no per-token inputs beyond the slot tensors

    def __init__(self, config: DeepseekV4ModelConfig, backends: Backends, dtype: torch.dtype, tokenizer=None,
                 keep_features: bool = False):
        super().__init__()
        c = self.config = config
        self.dtype = dtype
        self.backends = backends
        attention, moe, mhc = backends.attention, backends.moe, backends.mhc
        self.rotary_main = Rotary(inv_freq(c, compressed=False), attention)
        self.rotary_compress = Rotary(inv_freq(c, compressed=True), attention)
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            Block(c, i, self.rotary_compress if c.compress_ratios[i] else self.rotary_main, attention, moe, mhc)
            for i in range(c.num_layers)
        )
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, attention)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # classic MTP drafts from every token's final streams: ``ModelOutput.features`` [T, hc_mult * hidden]
        self.keep_features = keep_features
        cast_floating(self, dtype, keeps_fp32)
        self.requires_grad_(False)

    # -- weights ------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_name(module_path: str) -> str:
        """Our parameter path -> DeepSeek's tensor name (they differ only for mHC parameters)."""
        return _HC_NAMES.sub(lambda m: f"{m.group(1)}_{m.group(2)}", module_path)

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {self.checkpoint_name(k): (tuple(v.shape), v.dtype) for k, v in self.state_dict().items()}

    @staticmethod
    def memory_mapped(name: str) -> bool:
        return False

    def attach(self, extras: dict[str, torch.Tensor], device: torch.device, engram_tables: str) -> None:
        """Tensors the loader hands over outside the model's parameters; V4 has none (nor Engram tables)."""
        if extras:
            raise ValueError(f"unexpected extra tensors for DeepSeek-V4: {sorted(extras)[:5]}")

    # -- caches -------------------------------------------------------------------------------
    def compressed_ratios(self) -> dict[int, int]:
        """Compression ratio -> how many windows pool each compressor-state row (CSA windows overlap)."""
        c = self.config
        return {r: 2 if r == c.csa_ratio else 1 for r in set(c.compress_ratios) if r}

    def cache_kinds(self, kv_fp8: bool = False) -> list[CacheKind]:
        """``kv_fp8``: the attention rows (window and compressed entries) in DeepSeek-V4's FP8 layout."""
        c = self.config
        all_layers = tuple(range(c.num_layers))
        kinds = [sliding_kind("swa", c.window, (Pool("kv", all_layers, c.head_dim, self.dtype, fp8=kv_fp8),))]
        for ratio in sorted(set(c.compress_ratios) - {0}):
            layers = tuple(i for i, r in enumerate(c.compress_ratios) if r == ratio)
            overlap = 2 if ratio == c.csa_ratio else 1
            entries = [Pool("kv", layers, c.head_dim, self.dtype, fp8=kv_fp8)]
            state = [Pool("kv", layers, 2 * overlap * c.head_dim, torch.float32)]
            if ratio == c.csa_ratio:
                entries.append(Pool("index", layers, c.index_head_dim, self.dtype))
                state.append(Pool("index", layers, 4 * c.index_head_dim, torch.float32))
            kinds.append(CacheKind(f"comp{ratio}", ratio, tuple(entries)))
            kinds.append(compressor_state_kind(f"state{ratio}", ratio, overlap, tuple(state)))
        return kinds

    # -- forward ------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, caches: KVCache) -> ModelOutput:
        """The mHC streams [T, hc_mult, hidden] of every token in the step."""
        for meta in batch.compressed.values():  # every compressed layer rotates its new entries by these
            meta.close_phases = self.rotary_compress.phases(meta.close_positions)
        batch = batch.own_rows()  # context parallelism: this rank's tokens (otherwise all of them)
        x = self.embed(batch.token_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        phases = {
            self.rotary_main: self.rotary_main.phases(batch.positions),
            self.rotary_compress: self.rotary_compress.phases(batch.positions),
        }
        for layer in self.layers:
            streams = layer(streams, batch, phases[layer.attn.rotary], caches)
        streams = batch.gather(streams)
        return ModelOutput(streams, streams.flatten(1) if self.keep_features else None)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The streams collapsed and normalized: what the vocabulary projection reads."""
        return self.norm(self.hc_head(streams))

    def project_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.project_vocab(self.final_hidden(streams))
