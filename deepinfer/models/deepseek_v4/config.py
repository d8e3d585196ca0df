"""DeepSeek-V4 hyper-parameters read from either config.json dialect, and the RoPE frequencies they imply.

Two dialects exist. Hugging Face transformers writes ``layer_types`` + ``compress_rates``, ``mlp_layer_types`` and a
nested ``rope_parameters`` {"main", "compress"}. DeepSeek's official release writes a ``compress_ratios`` list (with
trailing entries for the MTP blocks), ``num_hash_layers`` and a flat ``rope_scaling``.

Which compressed layers carry a lightning indexer (CSA) and which do not (HCA) is explicit in the HF dialect (the
layer type names). The official dialect only gives ratios, so ratio 4 is read as CSA and any other non-zero ratio as
HCA, which is how every released V4 checkpoint pairs them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.runtime.quantization import weight_block_size

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

_SLIDING = "sliding_attention"
_CSA = "compressed_sparse_attention"
_HCA = "heavily_compressed_attention"
_DEFAULT_COMPRESS_RATES = {_CSA: 4, _HCA: 128}
_OFFICIAL_CSA_RATIO = 4
_MLP_TYPES = ("hash_moe", "moe")
# HF's defaults, used only when a config.json leaves the key out.
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_ROPE_FRACTION = 64 / 512
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(slots=True)
class DeepseekV4ModelConfig:
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
    compress_ratios: list[int]
    csa_ratio: int
    hash_layers: list[bool]
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
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_id: list[int]
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: torch.dtype
    quantization_config: dict[str, Any] | None
    # the routed experts' format where the config declares FP8 weights (``quantization_config``): the releases'
    # packed MXFP4 ("fp4") or FP8 tiles ("fp8", V4-Flash-Base). Loads read it only for random (dummy) weights:
    # a checkpoint's files say how each tensor is stored
    expert_dtype: str = "fp4"

    def __post_init__(self) -> None:
        _validate(self)
        self.weight_block_size  # a malformed block is a config error, reported now rather than at load

    @property
    def weight_block_size(self) -> tuple[int, int]:
        """FP8 weight tile (V4 ships 128 x 128); activations are rounded in 1 x (its column count) segments."""
        return weight_block_size(self.quantization_config, (128, 128))

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == self.csa_ratio

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> DeepseekV4ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"No config.json in model directory {str(path)!r}")
        return cls.from_dict(json.loads(config_file.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Unsupported model_type {model_type!r}; supported model types: {list(SUPPORTED_MODEL_TYPES)}"
            )
        num_layers = int(_required(d, "num_hidden_layers"))
        head_dim = int(_required(d, "head_dim"))
        compress_ratios, csa_ratio = _attention_schedule(d, num_layers)
        rope_theta, compress_rope_theta, yarn = _rope_setup(d)
        eos = d.get("eos_token_id", 1)
        return cls(
            vocab_size=int(_required(d, "vocab_size")),
            hidden_size=int(_required(d, "hidden_size")),
            num_layers=num_layers,
            num_heads=int(_required(d, "num_attention_heads")),
            head_dim=head_dim,
            rope_head_dim=_rope_head_dim(d, head_dim),
            q_lora_rank=int(_required(d, "q_lora_rank")),
            o_groups=int(_required(d, "o_groups")),
            o_lora_rank=int(_required(d, "o_lora_rank")),
            window=int(_required(d, "sliding_window")),
            compress_ratios=compress_ratios,
            csa_ratio=csa_ratio,
            hash_layers=_hash_layers(d, num_layers),
            n_routed_experts=int(_required(d, "n_routed_experts")),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_experts_per_tok=int(_required(d, "num_experts_per_tok")),
            moe_intermediate_size=int(_required(d, "moe_intermediate_size")),
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)),
            index_n_heads=int(_required(d, "index_n_heads")),
            index_head_dim=int(_required(d, "index_head_dim")),
            index_topk=int(_required(d, "index_topk")),
            hc_mult=int(_required(d, "hc_mult")),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            compress_rope_theta=compress_rope_theta,
            yarn=yarn,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 1)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            dtype=_dtype(d),
            quantization_config=d.get("quantization_config"),
            expert_dtype=d.get("expert_dtype") or "fp4",
        )


def inv_freq(config: DeepseekV4ModelConfig, compressed: bool) -> torch.Tensor:
    """fp32 inverse frequencies, one per interleaved RoPE pair ([rope_head_dim // 2]).

    Sliding-window layers use plain RoPE on ``rope_theta``. Compressed (CSA/HCA) layers use ``compress_rope_theta``,
    stretched by YaRN when configured. YaRN's attention factor is never applied: V4 leaves cos/sin unscaled.
    """
    dim = config.rope_head_dim
    base = config.compress_rope_theta if compressed else config.rope_theta
    # Same operation order as HF transformers, so both give bit-identical buffers.
    wavelength_scale = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    original = 1.0 / wavelength_scale
    if not compressed or config.yarn is None:
        return original
    yarn = config.yarn
    stretched = 1.0 / (yarn.factor * wavelength_scale)
    low, high = _yarn_blend_range(yarn, dim, base)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    # Pairs that rotate fast within the original context keep their frequency; slow ones are fully stretched.
    keep_original = 1 - ramp
    return stretched * (1 - keep_original) + original * keep_original


def _yarn_blend_range(yarn: YarnConfig, dim: int, base: float) -> tuple[float, float]:
    """Pair-index range over which YaRN blends the two frequencies.

    Pairs that turn more than ``beta_fast`` times over the original context keep their frequency; pairs that turn
    fewer than ``beta_slow`` times are fully stretched.
    """

    def pair_index_for(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        context = yarn.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index_for(yarn.beta_fast), pair_index_for(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _required(d: dict[str, Any], key: str, where: str = "config.json") -> Any:
    if d.get(key) is None:
        raise ValueError(f"{where} is missing required field {key!r}")
    return d[key]


def _number(cast: type, value: Any, key: str, where: str = "config.json") -> int | float:
    """``cast(value)``, refused naming the field where int()/float() would fail unnamed, or would silently round
    (2.5 layers), or take a bool or a string."""
    try:
        if isinstance(value, (bool, str)) or not isinstance(value, (int, float)):
            raise TypeError
        result = cast(value)
    except (TypeError, ValueError, OverflowError):
        result = None
    if result is None or (cast is int and result != value):
        kind = "an integer" if cast is int else "a number"
        raise ValueError(f"{where}: {key} must be {kind}, got {value!r}")
    return result


def _check_length(field: str, values: list, num_layers: int) -> None:
    if len(values) != num_layers:
        raise ValueError(f"{field} has {len(values)} entries but num_hidden_layers is {num_layers}")


def _attention_schedule(d: dict[str, Any], num_layers: int) -> tuple[list[int], int]:
    """Per-layer compression ratio (0 = sliding window only) and the ratio of the layers with an indexer."""
    layer_types = d.get("layer_types")
    if layer_types is not None:
        _check_length("layer_types", layer_types, num_layers)
        unknown = sorted(set(layer_types) - {_SLIDING, _CSA, _HCA})
        if unknown:
            raise ValueError(f"layer_types has unknown entries {unknown}; expected {[_SLIDING, _CSA, _HCA]}")
        rates = {**_DEFAULT_COMPRESS_RATES, **(d.get("compress_rates") or {})}
        csa_ratio = int(rates[_CSA])
        if _HCA in layer_types and int(rates[_HCA]) == csa_ratio:
            raise ValueError(f"compress_rates gives CSA and HCA the same ratio {csa_ratio}; they must differ")
        return [0 if t == _SLIDING else int(rates[t]) for t in layer_types], csa_ratio
    ratios = d.get("compress_ratios")
    if ratios is None:
        raise ValueError("config.json has neither layer_types nor compress_ratios")
    if len(ratios) < num_layers:
        raise ValueError(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {num_layers}")
    # Entries past the main layers describe the MTP blocks.
    return [int(r) for r in ratios[:num_layers]], _OFFICIAL_CSA_RATIO


def _hash_layers(d: dict[str, Any], num_layers: int) -> list[bool]:
    mlp_layer_types = d.get("mlp_layer_types")
    if mlp_layer_types is None:
        num_hash = int(d.get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS))
        return [layer < num_hash for layer in range(num_layers)]
    _check_length("mlp_layer_types", mlp_layer_types, num_layers)
    unknown = sorted(set(mlp_layer_types) - set(_MLP_TYPES))
    if unknown:
        raise ValueError(f"mlp_layer_types has unknown entries {unknown}; expected {list(_MLP_TYPES)}")
    return [t == "hash_moe" for t in mlp_layer_types]


def _rope_head_dim(d: dict[str, Any], head_dim: int) -> int:
    explicit = d.get("qk_rope_head_dim")
    fraction = d.get("partial_rotary_factor")
    from_fraction = None if fraction is None else int(head_dim * fraction)
    if explicit is not None and from_fraction is not None and int(explicit) != from_fraction:
        raise ValueError(
            f"qk_rope_head_dim ({explicit}) disagrees with partial_rotary_factor ({fraction}) x head_dim ({head_dim})"
        )
    if explicit is not None:
        return int(explicit)
    return from_fraction if from_fraction is not None else int(head_dim * _DEFAULT_ROPE_FRACTION)


def _rope_setup(d: dict[str, Any]) -> tuple[float, float, YarnConfig | None]:
    """(rope_theta, compress_rope_theta, yarn) from either HF's nested rope_parameters or a flat rope_scaling."""
    rope_theta = float(d.get("rope_theta", 10000.0))
    compress_rope_theta = float(d.get("compress_rope_theta", 160000.0))
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        rope_theta = float(params["main"].get("rope_theta", rope_theta))
        compress_rope_theta = float(params["compress"].get("rope_theta", compress_rope_theta))
        return rope_theta, compress_rope_theta, _yarn(params["compress"], "rope_parameters.compress")
    if d.get("rope_scaling"):
        return rope_theta, compress_rope_theta, _yarn(d["rope_scaling"], "rope_scaling")
    # A flat rope_parameters is HF's spelling of rope_scaling; its rope_theta is the main one, not the compressed one.
    return rope_theta, compress_rope_theta, _yarn(params, "rope_parameters")


def _yarn(scaling: dict[str, Any], where: str) -> YarnConfig | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"{where}: unsupported rope type {rope_type!r}; DeepSeek-V4 uses 'yarn' or 'default'")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is not None and attention_factor != 1.0:
        raise ValueError(f"{where}.attention_factor must be 1.0 (V4 does not scale cos/sin); got {attention_factor}")
    return YarnConfig(
        factor=float(_required(scaling, "factor", where)),
        original_max_position_embeddings=int(_required(scaling, "original_max_position_embeddings", where)),
        # A zero or missing beta means "use the paper's default", as in HF.
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        truncate=bool(scaling.get("truncate", True)),
    )


def _dtype(d: dict[str, Any]) -> torch.dtype:
    name = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    if name not in _DTYPES:
        raise ValueError(f"dtype/torch_dtype {name!r} is not supported; expected one of {list(_DTYPES)}")
    return _DTYPES[name]


def _validate(c: DeepseekV4ModelConfig) -> None:
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "rope_head_dim", "q_lora_rank",
                  "o_groups", "o_lora_rank", "window", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "csa_ratio"):
        if getattr(c, field) <= 0:
            raise ValueError(f"{field} must be positive; got {getattr(c, field)}")
    _check_length("compress_ratios", c.compress_ratios, c.num_layers)
    if c.expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8'; got {c.expert_dtype!r}")
    _check_length("hash_layers", c.hash_layers, c.num_layers)
    if any(r < 0 for r in c.compress_ratios):
        raise ValueError(f"compress_ratios must be >= 0; got {c.compress_ratios}")
    if c.head_dim % 2 or c.rope_head_dim % 2:
        raise ValueError(f"head_dim ({c.head_dim}) and rope_head_dim ({c.rope_head_dim}) must be even")
    if c.rope_head_dim > c.head_dim:
        raise ValueError(f"rope_head_dim ({c.rope_head_dim}) must not exceed head_dim ({c.head_dim})")
    if (c.num_heads * c.head_dim) % c.o_groups:
        raise ValueError(
            f"num_heads*head_dim ({c.num_heads}*{c.head_dim}) must be divisible by o_groups ({c.o_groups})"
        )
    if c.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {c.scoring_func!r} is not supported; expected one of {list(SCORING_FUNCS)}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ValueError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) exceeds n_routed_experts ({c.n_routed_experts})"
        )
