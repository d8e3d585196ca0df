"""Tiny random DeepSeek-V4.1 checkpoints in the released format, written without any reference implementation.

``TINY_V41`` gives every layer kind the engine implements one layer: 0-1 window only (1 with Engram); 2 a ratio-2
KV and index source; 3 reuses 2; 4 re-indexes 2's keys; 5 a ratio-1 KV source publishing candidate blocks; 6 reuses
5; 7 re-indexes inside 5's candidates (with Engram); 8 a window-only decoder layer; plus three DSpark entries.
``tools/goldens/v41_golden.py`` builds the NeMo AutoModel fixture from the same dict. ``TINY_VISION`` adds a
two-layer vision tower (``vision=True``), small enough that every resize branch runs on images of a few dozen
pixels; ``tools/goldens/v41_vision_golden.py`` records NeMo's outputs for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.loading.convert import QUANTIZATION_CONFIG, V41
from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer

TINY_V41 = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=9,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_lora_rank=32,
    o_groups=2,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    hc_mult=4,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0] + [0, 0, 0],  # + the three DSpark stages
    kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 4, 5, 7],
    # many heads: an all-negative (relu 0) score tie, broken arbitrarily by torch.topk, is rare
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    candidate_source_layer_id=5,
    candidate_topk_blocks=3,
    candidate_block_size=2,
    engram_layer_ids=[1, 7],
    engram_num_embeddings=[2000, 2000],
    engram_max_ngram_size=3,
    engram_vocab_size=97,
    engram_n_heads=2,
    engram_head_dim=32,
    num_nextn_predict_layers=3,
    dspark_block_size=3,
    dspark_noise_token_id=3,
    dspark_target_layer_ids=[6, 7, 8],
    dspark_markov_rank=8,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=1024,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 256},
)

TINY_VISION = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=48,
    patch_size=4,
    rope_theta=10000.0,
    downsample_ratio=2,  # 8 x 8 pixels per image token
    max_image_tokens=48,
    min_pixels=576,
    max_wh_ratio=4.0,
)
# The tiny tokenizer has no <｜deepseek_image｜>; its last id (a rare merge) stands in for it.
TINY_IMAGE_TOKEN_ID = TINY_V41["vocab_size"] - 1


def released_format(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float tensors under released names -> the released dtypes (``deepinfer.loading.convert.V41``: FP8/MXFP4 + e8m0
    scales, fp32, else bf16), as ``python -m deepinfer.loading.convert`` writes them."""
    out = {}
    for name, value in tensors.items():
        out.update(V41.store(name, value))
    return out


def write_v41_config(out_dir: str | Path, text: dict, tokenizer_vocab: int | None = None,
                     vision: dict | None = None) -> tuple[dict, object]:
    """config.json (released ``quantization_config`` included) and a test tokenizer in ``out_dir`` for the text
    config ``text`` (and the vision tower ``vision``, none by default); Engram's normalised vocabulary size is taken
    from that tokenizer. Returns (config, tokenizer)."""
    from deepinfer.models.deepseek_v41.engram import normalised_vocabulary
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = {**text, "model_type": "deepseek_v41_text", "dtype": "bfloat16"}
    build_tiny_tokenizer(out, vocab_size=tokenizer_vocab or text["vocab_size"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    text["engram_compressed_vocab_size"] = normalised_vocabulary(tokenizer)[1]
    d = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
         "vision_config": vision or {"num_hidden_layers": 0}, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
         "quantization_config": {**QUANTIZATION_CONFIG, "weight_block_size": list(V41.block)}}
    if vision:
        d["image_token_id"] = TINY_IMAGE_TOKEN_ID
    (out / "config.json").write_text(json.dumps(d, indent=2))
    return d, tokenizer


def build_tiny_v41(out_dir: str | Path, seed: int = 0, vision: bool = False, dspark: bool = False,
                   **overrides) -> Path:
    """Write config.json, model.safetensors (random weights, released format) and a tokenizer; return the dir.
    ``vision``: with ``TINY_VISION``'s tower; ``dspark``: with random DSpark draft stages (``mtp.*``). Each is drawn
    apart, so the text weights do not change."""
    from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
    from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.models.contract import Backends
    from deepinfer.plugins.builtin.torch_attention import TorchAttention
    from deepinfer.plugins.builtin.torch_linear import TorchLinear
    from deepinfer.plugins.builtin.torch_mhc import TorchMHC
    from deepinfer.plugins.builtin.torch_moe import TorchMoE

    out = Path(out_dir)
    d, tokenizer = write_v41_config(out, {**TINY_V41, **overrides}, vision=TINY_VISION if vision else None)
    config = DeepseekV41ModelConfig.from_dict(d)
    model = DeepseekV41ForCausalLM(config, Backends(TorchAttention(), TorchMoE(), TorchLinear(), TorchMHC()),
                                   torch.float32, tokenizer)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, spec in model.expected_tensors().items():
        if name.endswith("engram.embed.scale"):
            continue
        tensors.update(_split_experts(name, _draw(name, spec[0], config, g)))
    if config.vision_config is not None:
        tensors.update(tiny_vision_tensors(config.vision_config, config.hidden_size, seed))
    if dspark:
        tensors.update(tiny_draft_tensors(config, model, seed))
    save_file(released_format(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _draw(name: str, shape, config, g: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1 + normal(0.2)
    if name.endswith(("_base", "attn_sink")):
        return normal(0.5)
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith("_fn"):
        return normal(0.05)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return normal(0.1)
    if name.endswith(("embed.weight",)):
        return normal(1.0)
    std = shape[-1] ** -0.5
    return normal(4 * std if name == "head.weight" else std)


def tiny_draft_tensors(config, model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 tensors of the DSpark draft stages under the released names (``mtp.{i}.*``)."""
    from deepinfer.models.deepseek_v41.dspark import DSparkDraft

    with torch.device("meta"):
        draft = DSparkDraft(config, model.rotary_main, model.backends.attention, model.backends.moe, model.backends.mhc)
    g = torch.Generator().manual_seed(seed + 2)
    tensors = {}
    for name, value in draft.state_dict().items():
        released = "mtp." + model.checkpoint_name(name).removeprefix("layers.")
        tensors.update(_split_experts(released, _draw(released, tuple(value.shape), config, g)))
    return tensors


def _split_experts(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """``name``'s tensor as the release stores it: a stacked routed-expert weight becomes one tensor per expert."""
    stacked = re.fullmatch(r"((?:layers|mtp)\.\d+\.ffn\.experts)\.(w[123]\.weight)", name)
    if stacked is None:
        return {name: value}
    return {f"{stacked.group(1)}.{e}.{stacked.group(2)}": value[e] for e in range(value.shape[0])}


def tiny_vision_tensors(vision, text_hidden_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 vision-encoder tensors for ``vision`` (a ``VisionConfig``) under the released names."""
    from deepinfer.models.deepseek_v41.vision import VisionEncoder

    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for name, tensor in VisionEncoder(vision, text_hidden_size, torch.float32).state_dict().items():
        noise = torch.randn(tensor.shape, generator=g)
        if ".norm" in name:  # norm1, norm2 and the final norm
            tensors[name] = 1 + 0.2 * noise
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * noise
        elif name.startswith("image_"):
            tensors[name] = noise
        else:
            tensors[name] = noise * tensor.shape[-1] ** -0.5
    return tensors
