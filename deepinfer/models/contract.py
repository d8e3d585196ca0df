"""What an engine model class accepts and returns (docs/architecture.md, "Model contract"), and how its checkpoints
name their tensors (``CheckpointNaming``).

A model is built as ``Model(config, backends, dtype, tokenizer=None, keep_features=False)`` and its forward pass
is ``model(batch, caches) -> ModelOutput``. What a drafter reads comes back in that output, so nothing downstream
depends on attributes a forward pass left on the module; and what a drafter builds its stages from is
``DraftContext.of(model)``, so a drafter never holds the target model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.plugins.interfaces import AttentionBackend, LinearBackend, MHCBackend, MoEBackend


@dataclass(frozen=True, slots=True)
class CheckpointNaming:
    """How a model family's checkpoints name their tensors (each family's ``weight_names.py`` gives one).

    ``canonical``: a stored name -> the model's name, None for a tensor the model does not load. ``split``: a
    canonical-named tensor -> the canonical tensors it holds (itself, unless it fuses several). ``expert_slot``: a
    per-expert name -> (the name of the stacked tensor it fills, its expert index), None for other tensors."""

    canonical: Callable[[str], str | None]
    split: Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]
    expert_slot: Callable[[str], tuple[str, int] | None]


@dataclass(frozen=True, slots=True)
class Backends:
    attention: AttentionBackend
    moe: MoEBackend
    linear: LinearBackend
    mhc: MHCBackend


@dataclass(slots=True)
class ModelOutput:
    # [T, ...] every token's final state, before the final norm: what ``model.compute_logits`` reads
    hidden: torch.Tensor
    # [T, F] what the checkpoint's drafter reads per token; None unless the model was built with keep_features
    features: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DraftContext:
    """What a drafter may use of its target model: the pieces its draft stages share with it."""

    config: Any  # the target's model config
    dtype: torch.dtype
    device: torch.device
    backends: Backends
    embed: nn.Embedding
    rotary: Any  # the uncompressed layers' rotary embedding
    project_vocab: Callable[[torch.Tensor], torch.Tensor]
    vocab_head: torch.Tensor  # the weight ``project_vocab`` multiplies [vocab, hidden]: a draft vocabulary's rows

    @staticmethod
    def of(model: nn.Module) -> "DraftContext":
        return DraftContext(model.config, model.dtype, model.embed.weight.device, model.backends, model.embed,
                            model.rotary_main, model.project_vocab, model.head.weight)
