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


class SharedInput:
    """Projections of one input computed as one GEMM per weight format: ``projections(x)`` -> each one's output,
    by name.

    A decode step is mostly small GEMMs whose cost is their launch, not their bytes: attention reads its input with
    up to seven (queries, window KV, the compressors' KV and gates, the indexer's weights). ``fuse()``, once the
    weights are loaded, concatenates the weights (and scales) of each format by rows and points every projection's
    weight at its rows of the result, so memory is not doubled and each module still computes alone (a drafter's
    stage, or code that needs one output). Before ``fuse()`` each runs by itself. The outputs are column slices of
    the fused GEMM's result: row-strided, not contiguous.
    """

    __slots__ = ("projections", "groups")

    def __init__(self, projections: dict[str, nn.Module]):
        self.projections = projections
        self.groups: list[tuple[nn.Module, list[str], list[int]]] | None = None  # (fused module, names, widths)

    def fuse(self) -> None:
        formats: dict[tuple, list[str]] = {}
        for name, module in self.projections.items():
            formats.setdefault(_weight_format(module), []).append(name)
        self.groups = []
        for names in formats.values():
            members = [self.projections[n] for n in names]
            widths = [m.weight.shape[0] for m in members]
            if len(members) == 1:
                self.groups.append((members[0], names, widths))
                continue
            fused = _fused(members)
            for module, rows in zip(members, fused.weight.split(widths)):
                module.weight = nn.Parameter(rows, requires_grad=False)
            if fused.scale is not None:
                scale_widths = [m.scale.shape[0] for m in members]
                for module, rows in zip(members, fused.scale.split(scale_widths)):
                    module.scale = rows
            self.groups.append((fused, names, widths))

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.groups is None:
            return {name: module(x) for name, module in self.projections.items()}
        outputs = {}
        for module, names, widths in self.groups:
            outputs.update(zip(names, module(x).split(widths, dim=-1)))
        return outputs


def _weight_format(module: nn.Module) -> tuple:
    """Projections with equal keys fuse: same weight dtype and, when quantized, whole scale tiles per row block
    (the rows of one tile can not be split between two projections)."""
    weight, scale = module.weight, getattr(module, "scale", None)
    if scale is None:
        return (weight.dtype, weight.shape[1])
    rows_per_tile, rest = divmod(weight.shape[0], scale.shape[0])
    if rest:
        return (id(module),)  # a partial tile: alone
    return (weight.dtype, weight.shape[1], scale.dtype, scale.shape[1], rows_per_tile, module.activation_block)


def _fused(members: list[nn.Module]) -> nn.Module:
    first = members[0]
    with torch.device("meta"):  # its weight is the concatenation below: nothing to allocate first
        fused = Linear(first.weight.shape[1], sum(m.weight.shape[0] for m in members))
    fused.weight = nn.Parameter(torch.cat([m.weight for m in members]), requires_grad=False)
    if getattr(first, "scale", None) is not None:
        fused.scale = torch.cat([m.scale for m in members])
        fused.backend, fused.activation_block = first.backend, first.activation_block
    return fused


def fuse_shared_inputs(model: nn.Module) -> None:
    """``SharedInput.fuse`` for every set of projections ``model``'s modules keep (once its weights are loaded)."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, SharedInput):
                value.fuse()


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
