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
