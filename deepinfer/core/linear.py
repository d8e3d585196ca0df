"""Weights kept in the checkpoint's format, and building a model's tensors directly in those formats.

Models are constructed on the ``meta`` device, so nothing is allocated until the loader knows how each tensor is
stored: ``materialize`` then creates every checkpoint tensor on the target device, FP8 and MXFP4 weights as they are
shipped (with their e8m0 ``scale``), so device memory is about the checkpoint's size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.plugins.interfaces import LinearBackend

TensorSpec = tuple[tuple[int, ...], torch.dtype]


class Linear(nn.Module):
    """``y = x W^T`` over a float weight, or an FP8 / MXFP4 one with its ``scale``.

    The checkpoint decides the format (``materialize``); until then ``scale`` is None. Quantized weights are
    multiplied by the linear backend, which rounds the activations to FP8 as the release does.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.register_buffer("scale", None)
        self.backend: LinearBackend | None = None
        self.activation_block = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.weight)
        return self.backend.linear(x, self.weight, self.scale, self.activation_block)


class ExpertStack(nn.Module):
    """One projection of every routed expert: ``weight`` [E, R, C] float, FP8, or packed MXFP4 [E, R, C/2]."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features), requires_grad=False)
        self.register_buffer("scale", None)


def cast_floating(model: nn.Module, dtype: torch.dtype, keeps_fp32: Callable[[str], bool]) -> None:
    """Give every float parameter and buffer ``dtype``, or fp32 where ``keeps_fp32(name)`` says the release does."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if tensor.is_floating_point():
            # .data on the registered tensor itself: state_dict() would hand out detached copies
            tensor.data = tensor.data.to(torch.float32 if keeps_fp32(name) else dtype)


def quantizable_weights(model: nn.Module, checkpoint_name: Callable[[str], str]) -> set[str]:
    """Checkpoint names of the weights that may stay quantized (the others are dequantized when loaded)."""
    return {checkpoint_name(f"{path}.weight") for path, module in model.named_modules()
            if isinstance(module, (Linear, ExpertStack))}


def materialize(model: nn.Module, layout: dict[str, TensorSpec], checkpoint_name: Callable[[str], str],
                device: torch.device, backend: LinearBackend, activation_block: int) -> dict[str, torch.Tensor]:
    """Allocate (uninitialised) every tensor ``layout`` names on ``device``; returns them by checkpoint name.

    Quantized ``Linear`` modules are bound to ``backend``. Every parameter and buffer left on ``meta`` must be one
    the model computes itself, so a leftover is an error.
    """
    tensors = {}
    for path, module in model.named_modules():
        for leaf in itertools.chain(list(module._parameters), list(module._buffers)):
            name = checkpoint_name(f"{path}.{leaf}" if path else leaf)
            if name not in layout:
                continue
            shape, dtype = layout[name]
            tensor = torch.empty(shape, dtype=dtype, device=device)
            if leaf in module._parameters:
                module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
            else:
                module._buffers[leaf] = tensor
            tensors[name] = tensor
        if isinstance(module, Linear) and module.scale is not None:
            module.backend, module.activation_block = backend, activation_block
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"the checkpoint layout does not cover these model tensors: {left[:10]}")
    return tensors
