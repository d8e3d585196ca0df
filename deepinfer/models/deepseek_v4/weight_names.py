"""Maps every DeepSeek-V4 checkpoint naming onto DeepSeek's original tensor names, which DeepInfer uses internally.

Three namings occur: DeepSeek's original one (the official safetensors), HF transformers' in-memory module names
(``self_attn.q_a_proj``, fused ``experts.gate_up_proj``, ...), and what HF's ``save_pretrained`` writes, which is
the original naming with a ``model.`` prefix, ``embed_tokens`` and ``attn.norm`` for the attention KV norm.

Internally routed experts are stacked along a new leading expert dim (``layers.N.ffn.experts.w1.weight`` is
[E, I, H]); checkpoints store them one expert at a time (``ffn.experts.{e}.w1.weight``), which ``expert_slot``
recognises so the loader can stack them.
"""

from __future__ import annotations

import re

import torch

from deepinfer.models.contract import CheckpointNaming

# Applied in order to the name without its "model." prefix; each rule only rewrites HF spellings.
_RENAMES = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    # HF nests the indexer inside the compressor and flattens the indexer's own compressor into the indexer.
    (r"\.attn\.compressor\.indexer\.(kv_proj|gate_proj|position_bias|kv_norm)", r".attn.indexer.compressor.\1"),
    (r"\.attn\.compressor\.indexer\.(scorer\.)?", ".attn.indexer."),
    # save_pretrained inverts HF's "norm -> kv_norm" rename everywhere, so the attention KV norm comes back as "norm".
    (r"\.attn\.norm\.", ".attn.kv_norm."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.experts\.down_proj$", ".experts.w2.weight"),
    (r"\.weight_scale_inv$", ".scale"),
]
_COMPILED_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in _RENAMES]

# HF's in-memory fused experts: [E, 2I, H], the gate (w1) rows first, then the up (w3) rows.
_FUSED_GATE_UP = re.compile(r"^(layers\.\d+\.ffn\.experts)\.gate_up_proj$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123]\.(?:weight|scale))$")


def canonical_name(name: str) -> str | None:
    """DeepSeek's original name for a checkpoint tensor, or None for tensors DeepInfer does not load (MTP).

    HF's fused ``experts.gate_up_proj`` keeps that leaf name here; ``split_fused_experts`` turns it into w1 and w3.
    """
    name = name.removeprefix("model.")
    if name.startswith("mtp."):
        return None
    for pattern, replacement in _COMPILED_RENAMES:
        name = pattern.sub(replacement, name)
    return name


def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The canonical tensors inside one canonical-named checkpoint tensor (itself, unless it is a fused gate_up)."""
    fused = _FUSED_GATE_UP.match(name)
    if fused is None:
        return [(name, tensor)]
    gate_rows = tensor.shape[1] // 2
    prefix = fused.group(1)
    return [(f"{prefix}.w1.weight", tensor[:, :gate_rows]), (f"{prefix}.w3.weight", tensor[:, gate_rows:])]


def expert_slot(name: str) -> tuple[str, int] | None:
    """(stacked canonical name, expert index) for a per-expert name such as ``layers.3.ffn.experts.7.w1.weight``."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    return f"{match.group(1)}.{match.group(3)}", int(match.group(2))


def naming(canonical=canonical_name) -> CheckpointNaming:
    """The family's ``CheckpointNaming``, with another ``canonical`` mapping where one is given (V4.1's naming; a
    drafter's stages)."""
    return CheckpointNaming(canonical, split_fused_experts, expert_slot)
