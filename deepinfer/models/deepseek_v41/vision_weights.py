"""The vision encoder's checkpoint tensors, as the release names and stores them.

Names: ``vision.patch_embed.proj.{weight,bias}``, ``vision.blocks.N.{norm1,norm2}.weight``,
``vision.blocks.N.attn.{wqkv,wo}.{weight,bias}``, ``vision.blocks.N.mlp.{w1,w2}.weight``, ``vision.norm.weight``,
``aligner.{w1,w2}.{weight,bias}`` and ``image_{start,end,newline}`` (each [text hidden]); the HF-saved spelling
puts ``model.`` in front. The release keeps the projections in bf16 and the norms in fp32, none of them FP8; a
weight that comes FP8 with a ``.scale`` (a re-quantized checkpoint) is dequantized as the text loader does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from deepinfer.models.deepseek_v41.vision import VisionEncoder
from deepinfer.runtime.quantization import dequantize

_VISION_NAME = re.compile(r"(?:model\.)?(?:(?:vision|aligner)\..+|image_(?:start|end|newline))")


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision encoder (the text model skips these)."""
    return _VISION_NAME.fullmatch(name) is not None


def vision_name(name: str) -> str | None:
    """The encoder's name for a checkpoint tensor; None for the text model's tensors."""
    return name.removeprefix("model.") if is_vision_tensor(name) else None


def load_vision_weights(encoder: VisionEncoder, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the vision tensors among ``tensors`` (released names; others are ignored) into ``encoder``, each cast
    to its parameter's dtype; FP8 / MXFP4 weights are dequantized with their ``.scale``. Every parameter must be
    there with its shape; otherwise ValueError lists what is missing or mis-shaped."""
    stored = {vision_name(name): value for name, value in tensors.items() if is_vision_tensor(name)}
    targets = encoder.state_dict()
    problems = []
    for name, target in targets.items():
        value = stored.get(name)
        if value is None:
            problems.append(f"missing {name}")
            continue
        scale = stored.get(name.removesuffix("weight") + "scale") if name.endswith(".weight") else None
        if scale is not None:
            value = dequantize(value, scale, target.dtype)
        elif not value.is_floating_point() or value.dtype.itemsize == 1:
            problems.append(f"{name}: stored as {value.dtype} without its scale")
            continue
        if tuple(value.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(value.shape)}, the config needs {tuple(target.shape)}")
            continue
        target.copy_(value)
    unexpected = sorted(set(stored) - set(targets) - {n.removesuffix("weight") + "scale" for n in targets})
    problems += [f"unexpected {name}" for name in unexpected]
    if problems:
        raise ValueError("vision weights do not match vision_config:\n  " + "\n  ".join(problems))
