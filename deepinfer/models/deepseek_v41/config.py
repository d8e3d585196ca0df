"""DeepSeek-V4.1 hyper-parameters from its nested ``config.json`` (``model_type`` ``deepseek_v41``).

The text model lives under ``text_config`` (``deepseek_v41_text``), the vision tower under ``vision_config``
(``VisionConfig``; None when the checkpoint has none). A bare ``deepseek_v41_text`` dict is accepted too. The checks
mirror the released model's rules: which layers own a compressor (KV sources), which run an indexer (index
sources), which publish candidate blocks, and that every compressed layer reads a source with its own ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.runtime.quantization import weight_block_size

from deepinfer.models.deepseek_v4.config import YarnConfig, _dtype, _number, _required, _rope_head_dim, _rope_setup

SUPPORTED_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The vision tower and its image sizing, from ``config.json``'s ``vision_config`` (the released names; a key
    the checkpoint leaves out takes the release's value, as the reference does)."""

    num_layers: int = 32
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3  # ViT patches per side merged into one text-width image token
    max_image_tokens: int = 1024  # the whole image span, start and end included
    min_pixels: int = 295936  # smaller images are scaled up to about this area
    max_wh_ratio: float | None = None  # wider images are squeezed to this width / height

    _KEYS = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_heads",
             "intermediate_size": "intermediate_size", "patch_size": "patch_size", "rope_theta": "rope_theta",
             "downsample_ratio": "downsample_ratio", "max_image_tokens": "max_image_tokens",
             "min_pixels": "min_pixels", "max_wh_ratio": "max_wh_ratio"}

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "patch_size", "downsample_ratio",
                     "min_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision_config: {name} must be positive; got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision_config: hidden_size ({self.hidden_size}) / num_attention_heads "
                             f"({self.num_heads}) must be a whole head size divisible by 4 (2D RoPE rotates "
                             "row and column halves)")
        if self.max_image_tokens < 4:
            raise ValueError(f"vision_config: max_image_tokens must be >= 4 (start, one image token, its row end, "
                             f"end); got {self.max_image_tokens}")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"vision_config: rope_theta must be finite and positive; got {self.rope_theta}")
        if self.max_wh_ratio is not None and (not math.isfinite(self.max_wh_ratio) or self.max_wh_ratio < 1):
            raise ValueError(f"vision_config: max_wh_ratio must be null or finite and >= 1; got {self.max_wh_ratio}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> VisionConfig | None:
        """None for a checkpoint without a vision tower: no ``vision_config``, or one with no layers (text-only
        releases and the tiny test checkpoints write ``{"num_hidden_layers": 0}``)."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"config.json vision_config must be an object; got {type(d).__name__}")
        where = "config.json vision_config"
        if d.get("num_hidden_layers") is not None and _number(int, d["num_hidden_layers"], "num_hidden_layers",
                                                              where) == 0:
            return None
        values = {}
        for key, name in cls._KEYS.items():
            if key in d and not (name == "max_wh_ratio" and d[key] is None):
                values[name] = _number(float if name in ("rope_theta", "max_wh_ratio") else int, d[key], key, where)
        return cls(**values)


@dataclass(slots=True)
class DeepseekV41ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: list[int]  # one per main layer: 0 window only, else tokens per compressed entry
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    candidate_source_layer_id: int  # -1: no two-level indexer
    candidate_topk_blocks: int
    candidate_block_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnConfig | None
    engram_layer_ids: list[int]
    engram_num_embeddings: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark: dict[str, Any]
    bos_token_id: int | None
    eos_token_id: list[int]
    max_position_embeddings: int
    dtype: torch.dtype
    image_token_id: int | None = None
    vision_config: VisionConfig | None = None
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _validate(self)
        self.weight_block_size  # a malformed block is a config error, reported now rather than at load

    @property
    def weight_block_size(self) -> tuple[int, int]:
        """FP8 weight tile (V4.1 ships 32 x 32); activations are rounded in 1 x (its column count) segments."""
        return weight_block_size(self.quantization_config, (32, 32))

    # -- layer roles ----------------------------------------------------------------------------
    def kv_source(self, layer: int) -> int:
        """The layer whose compressed cache ``layer`` reads: the latest KV source at or below it."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    @property
    def hash_layers(self) -> list[bool]:
        return [False] * self.num_layers  # V4.1 has no hash-routed MoE layers

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV41ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"Unsupported model_type {model_type!r}; expected one of {list(SUPPORTED_MODEL_TYPES)}")
        top = d
        if model_type == "deepseek_v41":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("config.json: model_type 'deepseek_v41' needs a 'text_config' object")
        else:
            text = d
        where = "config.json text_config" if text is not d else "config.json"

        def req(key):
            return _required(text, key, where)

        def req_num(cast, key):
            return _number(cast, req(key), key, where)

        def opt_num(cast, key, default):
            return _number(cast, text.get(key, default), key, where)

        num_layers = req_num(int, "num_hidden_layers")
        ratios = [int(r) for r in req("compress_ratios")]
        if len(ratios) < num_layers:
            raise ValueError(f"{where}: compress_ratios has {len(ratios)} entries but num_hidden_layers is {num_layers}")
        head_dim = req_num(int, "head_dim")
        rope_theta, compress_rope_theta, yarn = _rope_setup(text)
        eos = text.get("eos_token_id", top.get("eos_token_id", 1))
        engram_layers = [int(i) for i in text.get("engram_layer_ids", [])]
        return cls(
            vocab_size=req_num(int, "vocab_size"),
            hidden_size=req_num(int, "hidden_size"),
            num_layers=num_layers,
            num_heads=req_num(int, "num_attention_heads"),
            head_dim=head_dim,
            rope_head_dim=_rope_head_dim(text, head_dim),
            q_lora_rank=req_num(int, "q_lora_rank"),
            o_groups=req_num(int, "o_groups"),
            o_lora_rank=req_num(int, "o_lora_rank"),
            window=req_num(int, "sliding_window"),
            # entries past the main layers describe the DSpark stages
            compress_ratios=ratios[:num_layers],
            kv_source_layer_ids=[int(i) for i in req("kv_source_layer_ids")],
            index_source_layer_ids=[int(i) for i in req("index_source_layer_ids")],
            candidate_source_layer_id=opt_num(int, "candidate_source_layer_id", -1),
            candidate_topk_blocks=opt_num(int, "candidate_topk_blocks", 0),
            candidate_block_size=opt_num(int, "candidate_block_size", 0),
            n_routed_experts=req_num(int, "n_routed_experts"),
            n_shared_experts=opt_num(int, "n_shared_experts", 1),
            num_experts_per_tok=req_num(int, "num_experts_per_tok"),
            moe_intermediate_size=req_num(int, "moe_intermediate_size"),
            scoring_func=text.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=opt_num(float, "routed_scaling_factor", 1.5),
            swiglu_limit=opt_num(float, "swiglu_limit", 10.0),
            index_n_heads=req_num(int, "index_n_heads"),
            index_head_dim=req_num(int, "index_head_dim"),
            index_topk=req_num(int, "index_topk"),
            hc_mult=req_num(int, "hc_mult"),
            hc_sinkhorn_iters=opt_num(int, "hc_sinkhorn_iters", 20),
            hc_eps=opt_num(float, "hc_eps", 1e-6),
            rms_norm_eps=opt_num(float, "rms_norm_eps", 1e-20),
            rope_theta=rope_theta,
            compress_rope_theta=compress_rope_theta,
            yarn=yarn,
            engram_layer_ids=engram_layers,
            engram_num_embeddings=[int(n) for n in text.get("engram_num_embeddings", [])],
            engram_max_ngram_size=opt_num(int, "engram_max_ngram_size", 4),
            engram_vocab_size=opt_num(int, "engram_vocab_size", 0),
            engram_n_heads=opt_num(int, "engram_n_heads", 0),
            engram_head_dim=opt_num(int, "engram_head_dim", 0),
            engram_pad_token_id=opt_num(int, "engram_pad_token_id", 2),
            engram_compressed_vocab_size=opt_num(int, "engram_compressed_vocab_size", 0),
            num_nextn_predict_layers=opt_num(int, "num_nextn_predict_layers", 0),
            dspark={k: v for k, v in text.items() if k.startswith("dspark_")},
            bos_token_id=text.get("bos_token_id", top.get("bos_token_id", 0)),
            eos_token_id=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            max_position_embeddings=opt_num(int, "max_position_embeddings", 1048576),
            dtype=_dtype(text if (text.get("dtype") or text.get("torch_dtype")) else top),
            image_token_id=top.get("image_token_id"),
            vision_config=VisionConfig.from_dict(top.get("vision_config")),
            quantization_config=top.get("quantization_config") or text.get("quantization_config"),
        )


def _layer_ids(c: DeepseekV41ModelConfig, name: str) -> list[int]:
    ids = getattr(c, name)
    if ids != sorted(set(ids)):
        raise ValueError(f"{name} must be strictly increasing without repeats; got {ids}")
    if any(not 0 <= i < c.num_layers for i in ids):
        raise ValueError(f"{name} {ids} refers to layers outside 0..{c.num_layers - 1}")
    return ids


def _validate(c: DeepseekV41ModelConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank",
                 "o_groups", "o_lora_rank", "window", "n_routed_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                 "hc_sinkhorn_iters"):
        if getattr(c, name) <= 0:
            raise ValueError(f"{name} must be positive; got {getattr(c, name)}")
    for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        value = getattr(c, name)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and positive; got {value}")
    if c.rope_head_dim % 2 or c.rope_head_dim > min(c.head_dim, c.index_head_dim):
        raise ValueError(f"qk_rope_head_dim ({c.rope_head_dim}) must be even and at most head_dim ({c.head_dim}) "
                         f"and index_head_dim ({c.index_head_dim})")
    if c.num_heads % c.o_groups:
        raise ValueError(f"num_attention_heads ({c.num_heads}) must be divisible by o_groups ({c.o_groups})")
    if c.n_shared_experts != 1:
        raise ValueError(f"DeepSeek-V4.1 has exactly one shared expert; n_shared_experts is {c.n_shared_experts}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts ({c.n_routed_experts})")
    if c.scoring_func != "sqrtsoftplus":
        raise ValueError(f"DeepSeek-V4.1 routes with scoring_func 'sqrtsoftplus'; got {c.scoring_func!r}")
    if any(r < 0 for r in c.compress_ratios):
        raise ValueError(f"compress_ratios must be >= 0; got {c.compress_ratios}")
    sources = _layer_ids(c, "kv_source_layer_ids")
    indexers = _layer_ids(c, "index_source_layer_ids")
    if not set(sources) <= set(indexers):
        raise ValueError(f"every KV source {sources} must also be an index source {indexers}")
    owner_ratio = None
    for layer, ratio in enumerate(c.compress_ratios):
        if ratio == 0:
            if layer in indexers:
                raise ValueError(f"layer {layer} is window-only (ratio 0) and cannot be a KV or index source")
            continue
        if layer in sources:
            owner_ratio = ratio
        if owner_ratio != ratio:
            raise ValueError(f"compressed layer {layer} (ratio {ratio}) has no preceding KV source with that ratio")
    cand = c.candidate_source_layer_id
    if cand >= 0:
        if cand not in sources:
            raise ValueError(f"candidate_source_layer_id {cand} must be a KV source {sources}")
        if c.candidate_block_size <= 0 or c.candidate_topk_blocks <= 0:
            raise ValueError("candidate_block_size and candidate_topk_blocks must be positive when "
                             "candidate_source_layer_id is set")
        later = [i for i in indexers if i > cand and c.kv_source(i) != cand]
        if later:
            raise ValueError(f"index layers {later} come after candidate source {cand} but read another KV source; "
                             "candidate blocks only index the candidate source's cache")
    elif cand != -1:
        raise ValueError(f"candidate_source_layer_id must be -1 (off) or a layer id; got {cand}")
    engram = _layer_ids(c, "engram_layer_ids")
    if engram:
        if len(c.engram_num_embeddings) != len(engram):
            raise ValueError(f"engram_num_embeddings {c.engram_num_embeddings} needs one table size per "
                             f"engram layer {engram}")
        for name in ("engram_vocab_size", "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size"):
            if getattr(c, name) <= 0:
                raise ValueError(f"{name} must be positive when engram_layer_ids is set; got {getattr(c, name)}")
        if c.engram_max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be >= 2; got {c.engram_max_ngram_size}")
        if not 0 <= c.engram_pad_token_id < c.vocab_size:
            raise ValueError(f"engram_pad_token_id {c.engram_pad_token_id} is outside the vocabulary")
    if c.num_nextn_predict_layers < 0:
        raise ValueError(f"num_nextn_predict_layers must be >= 0; got {c.num_nextn_predict_layers}")
    if c.num_nextn_predict_layers:
        targets = c.dspark.get("dspark_target_layer_ids", [])
        if any(not 0 <= int(t) < c.num_layers for t in targets):
            raise ValueError(f"dspark_target_layer_ids {targets} refers to layers outside 0..{c.num_layers - 1}")
        for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"):
            if name in c.dspark and int(c.dspark[name]) <= 0:
                raise ValueError(f"{name} must be positive when num_nextn_predict_layers > 0; got {c.dspark[name]}")
