"""DeepSeek-V4.1 (V4.1-Flash) on DeepInfer's paged caches.

Checkpoint layout (the released Hugging Face repository; these names are used as is):

* ``embed.weight``, ``head.weight``, ``norm.weight`` (bf16; no ``hc_head``: the last ``pre`` collapses the streams)
* ``layers.N.{attn_norm,ffn_norm}.weight``, ``layers.N.hc_{attn,ffn}_{fn,base,scale}`` (fp32, scale has 3 entries)
* ``layers.N.attn.{wq_a,wq_b,wkv,wo_a,wo_b}.{weight,scale}`` FP8 e4m3 with e8m0 scales per 32x32 block;
  ``attn.{q_norm,kv_norm}.weight``, ``attn.attn_sink`` (fp32)
* KV sources: ``attn.compressor.{wkv,wgate}.weight`` (fp32; ratio 1 has no ``wgate``), ``attn.compressor.norm.weight``,
  ``attn.indexer.{wk,k_norm}.weight``; index sources: ``attn.indexer.wq_b.{weight,scale}``,
  ``attn.indexer.weights_proj.weight``
* ``layers.N.ffn.gate.{weight,bias,bias_vl}`` (image tokens pick experts by score + bias_vl),
  ``ffn.shared_experts.w{1,2,3}`` FP8, ``ffn.experts.E.w{1,2,3}.{weight,scale}`` MXFP4 (int8, two e2m1 per byte,
  e8m0 scale per 32 inputs)
* Engram layers: ``layers.N.engram.embed.{weight,scale}`` (FP8 rows, e8m0 per 32 channels),
  ``engram.wkv.{weight,scale}`` FP8, ``engram.{q_weight,k_weight}`` [hc_mult, hidden]
* ``mtp.{0,1,2}.*``: the DSpark draft stages (not read here: ``dspark.py``, loaded by the features/mtp drafter)
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.runner.forward_batch import ForwardBatch
from deepinfer.runtime.kv_cache import CacheKind, KVCache, Pool, compressor_state_kind, sliding_kind
from deepinfer.runtime.linear import cast_floating
from deepinfer.runner.step_inputs import scatter_rows
from deepinfer.logger import init_logger
from deepinfer.models.deepseek_v4.layers import RMSNorm
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v41.attention import Attention, Selection
from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
from deepinfer.models.deepseek_v41.engram import Engram, NgramHasher
from deepinfer.models.deepseek_v41.layers import ComplexRotary, MixPredictor
from deepinfer.models.contract import Backends, ModelOutput
from deepinfer.plugins.interfaces import AttentionBackend, MoEBackend, MHCBackend

logger = init_logger(__name__)

# Tensors kept in fp32 whatever the model dtype (as the release ships or computes them; the router multiplies its
# weight in fp32). The vocabulary head stays in the model dtype, as shipped (bf16): the linear backend's ``logits``
# computes in fp32 from it, reading half the bytes an fp32 copy would.
_FP32_SUFFIXES = ("norm.weight", "attn_sink", "gate.bias", "gate.bias_vl", ".gate.weight", "compressor.wkv.weight",
                  "compressor.wgate.weight", "markov_head.head.weight")
_HC_NAMES = re.compile(r"(hc_attn|hc_ffn)\.(fn|base|scale)$")
_ENGRAM_TABLE = re.compile(r"layers\.(\d+)\.engram\.embed\.(weight|scale)$")


def engram_tables_on_device(choice: str, size: int, device: torch.device) -> bool:
    """``choice`` (``EngineConfig.engram_tables``): ``auto`` reads tables of ``size`` bytes on ``device`` when they
    take at most an eighth of a CUDA device's memory; on a CPU the memory-mapped tables are already where the step
    runs."""
    if choice != "auto":
        return choice == "device"
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return size <= torch.cuda.get_device_properties(device).total_memory / 8
    return False  # other accelerators: their memory is not asked here


def keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES) or _HC_NAMES.search(name) is not None


class Block(nn.Module):
    def __init__(self, config: DeepseekV41ModelConfig, layer_id: int, rotary: ComplexRotary,
                 attention: AttentionBackend, moe: MoEBackend, mhc: MHCBackend):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_attn = MixPredictor(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.hc_ffn = MixPredictor(c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, mhc)
        self.attn = Attention(c, layer_id, rotary, attention)
        self.ffn = MoE(c, False, moe)
        self.ffn.gate.register_buffer("bias_vl", torch.zeros(c.n_routed_experts, dtype=torch.float32))
        self.engram = Engram(c, layer_id, mhc) if layer_id in c.engram_layer_ids else None
        self.mhc = mhc

    def forward(self, streams, pre, batch: ForwardBatch, phases, caches, selection, features: list | None = None,
                engram_rows: torch.Tensor | None = None, image_mask: torch.Tensor | None = None):
        """``engram_rows``: this layer's Engram table rows (``NgramHasher``), unless the step gathered its values on
        the host; ``image_mask`` [T] bool: the rows that are image tokens (None: none are)."""
        if self.engram is not None:
            i = self.engram.index
            if "engram_values" in batch.extras:  # gathered on the host
                values, exponents = batch.extras["engram_values"][:, i], batch.extras["engram_exponents"][:, i]
            else:
                values, exponents = self.engram.gather(engram_rows)
            remembered = self.engram(streams, values, exponents)
            # the release gates no memory into image tokens: their streams pass unchanged
            streams = remembered if image_mask is None else torch.where(image_mask[:, None, None], streams, remembered)
        if features is not None:  # what a DSpark draft reads from this layer: its input, streams averaged
            features.append(streams.mean(dim=1))
        x, attn_pre, post, comb = self.hc_attn.enter(streams, pre, self.attn_norm)
        streams = self.mhc.expand(streams, self.attn(x, batch, phases, caches, selection), post, comb)
        x, ffn_pre, post, comb = self.hc_ffn.enter(streams, attn_pre, self.ffn_norm)
        return self.mhc.expand(streams, self.ffn(x, batch.token_ids, image_mask), post, comb), ffn_pre


class DeepseekV41ForCausalLM(nn.Module):
    def __init__(self, config: DeepseekV41ModelConfig, backends: Backends, dtype: torch.dtype, tokenizer=None,
                 keep_features: bool = False):
        super().__init__()
        c = self.config = config
        self.dtype = dtype
        self.backends = backends
        attention, moe, mhc = backends.attention, backends.moe, backends.mhc
        self.rotary_main = ComplexRotary(c, compressed=False, backend=attention)
        self.rotary_compress = ComplexRotary(c, compressed=True, backend=attention)
        self.mhc = mhc
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            Block(c, i, self.rotary_compress if c.compress_ratios[i] else self.rotary_main, attention, moe, mhc)
            for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, attention)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        cast_floating(self, dtype, keeps_fp32)
        if c.engram_layer_ids:
            if tokenizer is None:
                raise ValueError("DeepSeek-V4.1's Engram layers hash normalised token ids and need the tokenizer")
            # an n-gram stops at an image token (the release hashes no image position), known by its id
            self.ngram_hasher = NgramHasher(c, tokenizer, c.image_token_id if c.vision_config else None)
        else:
            self.ngram_hasher = None
        # the first window-only decoder layer: every layer after the last KV source keeps only its sliding window
        # of KV, so SWA bounded replay may run these on a suffix of each prompt (``ForwardBatch.replay``)
        self.decoder_start = max(c.kv_source_layer_ids) + 1
        # the layers whose input the checkpoint's DSpark stages read (``ModelOutput.features``, [T, layers * hidden])
        self.feature_layers: tuple[int, ...] = (
            tuple(int(i) for i in c.dspark["dspark_target_layer_ids"]) if keep_features and c.dspark else ())
        self.requires_grad_(False)

    # -- weights ------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_name(module_path: str) -> str:
        return _HC_NAMES.sub(lambda m: f"{m.group(1)}_{m.group(2)}", module_path)

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        expected = {self.checkpoint_name(k): (tuple(v.shape), v.dtype) for k, v in self.state_dict().items()}
        c = self.config
        for layer, rows in zip(c.engram_layer_ids, c.engram_num_embeddings):
            expected[f"layers.{layer}.engram.embed.weight"] = ((rows, c.engram_head_dim), torch.float8_e4m3fn)
            expected[f"layers.{layer}.engram.embed.scale"] = ((rows, c.engram_head_dim // 32), torch.float8_e8m0fnu)
        return expected

    @staticmethod
    def memory_mapped(name: str) -> bool:
        """Engram tables are read in place from the checkpoint files."""
        return _ENGRAM_TABLE.match(name) is not None

    def attach(self, extras: dict[str, torch.Tensor], device: torch.device, engram_tables: str) -> None:
        """The Engram tables, memory-mapped: copied to ``device`` when they fit (``engram_tables``), where each step
        hashes and gathers its rows itself; otherwise gathered on the host with the step's inputs."""
        engrams = [layer.engram for layer in self.layers if layer.engram is not None]
        tables = {}
        for engram in engrams:
            i = self.config.engram_layer_ids[engram.index]
            tables[engram] = extras[f"layers.{i}.engram.embed.weight"], extras[f"layers.{i}.engram.embed.scale"]
        size = sum(t.numel() * t.element_size() for pair in tables.values() for t in pair)
        on_device = engram_tables_on_device(engram_tables, size, device)
        for engram, (table, scale) in tables.items():
            engram.table, engram.table_scale = (table.to(device), scale.to(device)) if on_device else (table, scale)
        if engrams:
            self.ngram_hasher.to(device if on_device else torch.device("cpu"))
            self.needs_host_tokens = not on_device
            logger.info("Engram tables (%.2f GB): %s", size / 1e9,
                        f"on {device}, hashed and gathered inside each step" if on_device else
                        "on the host, gathered there for each step (the step waits for the previous one's tokens)")

    # -- caches -------------------------------------------------------------------------------
    def compressed_ratios(self) -> dict[int, int]:
        """Compression ratio -> pooling overlap (0: no compressor state is kept for it)."""
        return {r: (1 if r > 1 else 0) for r in set(self.config.compress_ratios) if r}

    graph_blocker = None  # Engram's inputs arrive with the step's inputs (host_inputs)
    needs_host_tokens = True  # until ``attach`` places the Engram tables

    def host_inputs(self, token_ids: torch.Tensor, history: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token inputs prepared on the host with the step's slot tensors. Engram tables on the device: the
        preceding token ids [T, N-1] (the step hashes them with its own tokens). On the host: every Engram layer's
        table rows, [T, layers, lookups, dim] FP8 values and [T, layers, lookups, dim/32] scale exponents, hashed
        from ``token_ids``, which must then hold values, not placeholders."""
        if not self.needs_host_tokens:
            return {"engram_history": history}
        ngrams = self.ngram_hasher.ngrams(token_ids, history)
        values, exponents = zip(*(layer.engram.gather(self.ngram_hasher(ngrams, layer.engram.index))
                                  for layer in self.layers if layer.engram is not None))
        return {"engram_values": torch.stack(values, 1), "engram_exponents": torch.stack(exponents, 1)}

    @property
    def token_history(self) -> int:
        return self.config.engram_max_ngram_size - 1 if self.config.engram_layer_ids else 0

    def cache_kinds(self, kv_fp8: bool = False) -> list[CacheKind]:
        if kv_fp8:  # its rows are 512 wide too, but its compressed entries are NVFP4-rounded: another layout
            raise ValueError("kv_cache_dtype='fp8' (DeepSeek-V4's FP8 KV layout) serves the DeepSeek-V4 family; "
                             "V4.1's cache layout has no FP8 form yet: use kv_cache_dtype='auto'")
        c = self.config
        kinds = [sliding_kind("swa", c.window, (Pool("kv", tuple(range(c.num_layers)), c.head_dim, self.dtype),))]
        for ratio in sorted(self.compressed_ratios()):
            sources = tuple(s for s in c.kv_source_layer_ids if c.compress_ratios[s] == ratio)
            kinds.append(CacheKind(f"comp{ratio}", ratio, (Pool("kv", sources, c.head_dim, self.dtype),
                                                           Pool("index", sources, c.index_head_dim, self.dtype))))
            if ratio > 1:
                state = (Pool("kv", sources, 2 * c.head_dim, torch.float32),)
                kinds.append(compressor_state_kind(f"state{ratio}", ratio, 1, state))
        return kinds

    # -- forward ------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, caches: KVCache) -> ModelOutput:
        """The collapsed hidden state [T, hidden] of every token in the step (before the final norm)."""
        for meta in batch.compressed.values():  # every compressed layer rotates its new entries by these
            meta.close_phases = self.rotary_compress.phases(meta.close_positions)
        batch = own = batch.own_rows()  # context parallelism: this rank's tokens (otherwise all of them)
        x = self.embed(batch.token_ids)
        image_mask = None
        if batch.images is not None:  # image spans hold the vision encoder's embeddings, not their token's
            x = x.index_copy(0, batch.images.rows, batch.images.embeddings.to(x.dtype))
            image_mask = batch.images.mask(x.shape[0])
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        pre = torch.zeros(x.shape[0], self.config.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1  # the first sublayer reads stream 0, the embedding
        phases = {
            self.rotary_main: self.rotary_main.phases(batch.positions),
            self.rotary_compress: self.rotary_compress.phases(batch.positions),
        }
        selection = Selection()
        features = []
        replay = batch.replay
        ngrams = None  # Engram's n-grams of the batch the layers read, hashed by each Engram layer
        for i, layer in enumerate(self.layers):
            if i == self.decoder_start and replay is not None:  # the decoder layers run on the replayed rows only
                rows, batch, ngrams = replay.rows, replay.batch, None
                if not rows.numel():  # a prefill chunk wholly before its replay start: no decoder work at all
                    streams, pre = streams[:0], pre[:0]
                    features += [streams[:, 0] for j in self.feature_layers if j >= i]
                    break
                streams, pre = streams[rows], pre[rows]
                phases = {rotary: p[rows] for rotary, p in phases.items()}
                selection = Selection(*(None if t is None else t[rows] for t in (selection.slots, selection.candidates)))
                image_mask = None if image_mask is None else image_mask[rows]
            wanted = features if i in self.feature_layers else None
            engram_rows = None
            if layer.engram is not None and "engram_history" in batch.extras:  # tables on the device
                if ngrams is None:
                    ngrams = self.ngram_hasher.ngrams(batch.token_ids, batch.extras["engram_history"])
                engram_rows = self.ngram_hasher(ngrams, layer.engram.index)
            streams, pre = layer(streams, pre, batch, phases[layer.attn.rotary], caches, selection, wanted,
                                 engram_rows, image_mask)
        hidden = self.mhc.collapse(streams, pre)
        if replay is not None:  # back in step order; rows the decoder skipped stay zero (they need no logits)
            hidden = scatter_rows(hidden, replay.rows, x.shape[0])
            features = [f if f.shape[0] == x.shape[0] else scatter_rows(f, replay.rows, x.shape[0]) for f in features]
        return ModelOutput(own.gather(hidden), torch.cat(features, dim=-1) if features else None)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The normalized hidden state, fp32: what the vocabulary projection reads."""
        return self.norm(hidden).float()

    def project_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of fp32 hidden states, by the linear backend."""
        return self.backends.linear.logits(hidden, self.head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_vocab(self.final_hidden(hidden))
