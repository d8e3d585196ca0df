"""Tiny random DeepSeek-V4 checkpoints written by HF transformers, for tests and demos.

The weights are drawn so that logits are decisive (so greedy decoding is not a coin toss
between near-equal tokens) and every parameter HF initialises to a constant (sinks, position
biases, routing bias, hash table, mHC biases) is random, so parity tests exercise them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer

TINY_V4 = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    sliding_window=8,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    num_hash_layers=1,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1},
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
)


# A larger (still small) shape for CPU benchmarks: compute, not Python overhead, dominates.
SMALL_V4 = dict(
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    head_dim=128,
    qk_rope_head_dim=32,
    q_lora_rank=256,
    o_groups=4,
    o_lora_rank=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    sliding_window=64,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=32,
    layer_types=["sliding_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2 + ["sliding_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    max_position_embeddings=1024,
)


def build_tiny_v4(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors and a tokenizer into ``out_dir``; return it."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = DeepseekV4Config(**{**TINY_V4, **overrides})
    model = DeepseekV4ForCausalLM(config).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(_draw(name, tensor, config, generator))
    model.save_pretrained(out)
    build_tiny_tokenizer(out, vocab_size=config.vocab_size)
    _drop_generation_defaults(out)
    return out


def _draw(name: str, tensor: torch.Tensor, config, generator: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(tensor.shape, generator=generator) * std

    if name.endswith("tid2eid"):
        # distinct experts per token, as the real table has
        scores = torch.rand(tensor.shape[0], config.n_routed_experts, generator=generator)
        return scores.topk(tensor.shape[1], dim=-1).indices
    if "inv_freq" in name:
        return tensor
    if name.endswith(("sinks",)):
        return normal(1.0)
    if name.endswith(("position_bias", "e_score_correction_bias")):
        return normal(0.3)
    if name.endswith(("base", "hc_base")):
        return normal(0.3)
    if name.endswith(("scale", "hc_scale")):
        return 1.0 + normal(0.2)
    if "norm" in name:
        return 1.0 + normal(0.1)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    fan_in = tensor.shape[-1]
    return normal(fan_in**-0.5)


def _drop_generation_defaults(out: Path) -> None:
    # HF writes generation_config.json; DeepInfer does not read it, tests keep it for HF generate.
    path = out / "generation_config.json"
    if path.exists():
        data = json.loads(path.read_text())
        data.pop("transformers_version", None)
        path.write_text(json.dumps(data, indent=2))


def add_mtp_layer(out_dir: str | Path, seed: int = 1) -> Path:
    """Give a tiny V4 checkpoint written by ``build_tiny_v4`` a random classic MTP layer (``mtp.0.*``, DeepSeek's
    names, one tensor per expert) and ``num_nextn_predict_layers: 1``. HF transformers has no MTP layer, so the
    tensors come from DeepInfer's own module."""
    from safetensors.torch import load_file, save_file

    from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig, inv_freq
    from deepinfer.models.deepseek_v4.layers import Rotary
    from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.models.deepseek_v4.mtp import MTPLayer

    out = Path(out_dir)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    c = DeepseekV4ModelConfig.from_dict(config)
    layer = MTPLayer(c, Rotary(inv_freq(c, compressed=False), None), None, None, None)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(out / "model.safetensors")
    for path, tensor in layer.state_dict().items():
        name = "mtp.0." + DeepseekV4ForCausalLM.checkpoint_name(path)
        value = _draw(name, tensor.float(), c, generator)
        if ".ffn.experts." in name:  # stacked [E, ...] here, one tensor per expert in checkpoints
            prefix, leaf = name.rsplit(".experts.", 1)
            tensors.update({f"{prefix}.experts.{e}.{leaf}": value[e].contiguous() for e in range(value.shape[0])})
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return out
