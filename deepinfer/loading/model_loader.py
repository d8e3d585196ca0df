"""Building a model on its device straight from the checkpoint, in the checkpoint's own formats."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from deepinfer.runtime.linear import fuse_shared_inputs, materialize, quantizable_weights
from deepinfer.models.contract import Backends
from deepinfer.loading.weights import dummy_layout, fill_dummy, load_state_dict, plan_load, stream_into
from deepinfer.models.deepseek_v4.weight_names import naming
from deepinfer.models.deepseek_v41.vision import Attend, VisionEncoder, vision_attention
from deepinfer.models.deepseek_v41.vision_weights import vision_name
from deepinfer.loading.model_registry import checkpoint_naming, model_class
from deepinfer.plugins.interfaces import AttentionBackend, LinearBackend, MHCBackend, MoEBackend


def load_model(model_config, model_dir: Path, *, attention: AttentionBackend, moe: MoEBackend,
               linear: LinearBackend, mhc: MHCBackend, dtype: torch.dtype, device: torch.device, tokenizer=None,
               engram_tables: str, quantization: str = "auto", load_format: str = "auto", seed: int = 0,
               expert_parallel=None, keep_features: bool = False) -> nn.Module:
    """The model with its weights on ``device``.

    ``quantization="auto"`` keeps FP8 / MXFP4 weights as the checkpoint stores them (device memory about the
    checkpoint's size); ``"none"`` dequantizes them to ``dtype`` as they are read, for debugging. ``load_format``
    ``"dummy"`` skips the weight files: random weights are created on ``device`` in the formats ``config.json``
    declares (FP8 / MXFP4 with a ``quantization_config``, ``dtype`` without one). With ``expert_parallel``
    (``deepinfer.parallel.expert_parallel``) each MoE layer keeps, and reads, only this rank's experts.
    ``engram_tables``: where DeepSeek-V4.1's Engram tables are read (``EngineConfig.engram_tables``).
    ``keep_features``: each forward pass also returns what the checkpoint's drafter reads (``ModelOutput``).
    """
    # meta: no memory is touched until the checkpoint says how each tensor is stored
    with torch.device("meta"):
        model = model_class(model_config)(model_config, Backends(attention, moe, linear, mhc), dtype,
                                          tokenizer=tokenizer, keep_features=keep_features)
    held = _hold_experts(model, expert_parallel) if expert_parallel is not None else None
    expected = model.expected_tensors()
    quantizable = quantizable_weights(model, model.checkpoint_name) if quantization == "auto" else set()
    if load_format == "dummy" and model_config.quantization_config is None:
        quantizable = set()  # without weight files the config is the only word on formats: it declares none
    block = model_config.weight_block_size
    if load_format == "dummy":
        mapped = {name for name in expected if model.memory_mapped(name)}
        layout = dummy_layout({n: s for n, s in expected.items() if n not in mapped}, quantizable, block,
                              fp8_experts=getattr(model_config, "expert_dtype", "fp4") == "fp8")
        tensors = materialize(model, layout, model.checkpoint_name, device, linear, block[1])
        extras = {name: torch.empty(expected[name][0], dtype=expected[name][1]) for name in mapped}
        fill_dummy({**tensors, **extras}, seed, model_config.n_routed_experts)
    else:
        plan = plan_load(model_dir, expected, naming=checkpoint_naming(model_config), quantizable=quantizable,
                         block=block, memory_mapped=model.memory_mapped, held_experts=held)
        tensors = materialize(model, plan.layout, model.checkpoint_name, device, linear, block[1])
        extras = stream_into(plan, tensors)
    model = model.to(device)  # the buffers the model computes itself (RoPE)
    model.attach(extras, device, engram_tables)
    fuse_shared_inputs(model)
    return model


def _hold_experts(model: nn.Module, expert_parallel) -> dict[str, list[int]]:
    """Shrinks each decoder layer's expert stacks to this rank's slots; returns, by stacked checkpoint name, the
    checkpoint expert each slot holds."""
    moe_layers = [layer.ffn for layer in model.layers]
    expert_parallel.attach(moe_layers)
    held = {}
    for index, moe in enumerate(moe_layers):
        experts = expert_parallel.held_experts(index)
        moe.hold_experts(len(experts))
        for stack in ("w1", "w3", "w2"):
            for leaf in ("weight", "scale"):
                held[model.checkpoint_name(f"layers.{index}.ffn.experts.{stack}.{leaf}")] = experts
    return held


def load_part(module: nn.Module, model_config, model_dir: Path, checkpoint_name, canonical, linear: LinearBackend,
              device: torch.device, quantization: str = "auto", load_format: str = "auto", seed: int = 0) -> None:
    """Fills ``module`` (built on ``meta``) from the checkpoint tensors ``canonical`` maps onto its names (the
    others are skipped), as ``load_model`` does (``quantization`` and ``load_format`` likewise): e.g. a draft
    model's stages."""
    expected = {checkpoint_name(k): (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    quantizable = quantizable_weights(module, checkpoint_name) if quantization == "auto" else set()
    if load_format == "dummy" and model_config.quantization_config is None:
        quantizable = set()
    block = model_config.weight_block_size
    if load_format == "dummy":
        layout = dummy_layout(expected, quantizable, block,
                              fp8_experts=getattr(model_config, "expert_dtype", "fp4") == "fp8")
        fill_dummy(materialize(module, layout, checkpoint_name, device, linear, block[1]), seed,
                   model_config.n_routed_experts)
    else:
        plan = plan_load(model_dir, expected, naming=naming(canonical), quantizable=quantizable, block=block)
        stream_into(plan, materialize(module, plan.layout, checkpoint_name, device, linear, block[1]))
    fuse_shared_inputs(module)


def load_vision_encoder(model_config, model_dir: Path, dtype: torch.dtype = torch.bfloat16,
                        attend: Attend = vision_attention) -> VisionEncoder:
    """DeepSeek-V4.1's vision encoder (``model_config.vision_config``) on the CPU, from the checkpoint's vision
    tensors only, its attention ``attend``; the loader's header checks name any missing, mis-shaped or unexpected
    one with its file."""
    if model_config.vision_config is None:
        raise ValueError(f"the checkpoint in {model_dir} has no vision tower (config.json vision_config)")
    encoder = VisionEncoder(model_config.vision_config, model_config.hidden_size, dtype, attend)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in encoder.state_dict().items()}
    encoder.load_state_dict(load_state_dict(model_dir, expected, naming=naming(vision_name)))
    return encoder
