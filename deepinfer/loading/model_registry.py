"""Which model class serves a checkpoint, chosen by its ``config.json`` ``model_type``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.contract import CheckpointNaming
from deepinfer.models.deepseek_v4.weight_names import naming
from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.vision_weights import is_vision_tensor

MODELS: dict[str, tuple[type, type]] = {
    "deepseek_v4": (DeepseekV4ModelConfig, DeepseekV4ForCausalLM),
    "deepseek_v41": (DeepseekV41ModelConfig, DeepseekV41ForCausalLM),
    "deepseek_v41_text": (DeepseekV41ModelConfig, DeepseekV41ForCausalLM),
}


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"No config.json in model directory {str(model_dir)!r}")
    try:
        d = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file} is not valid JSON: {err}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(d).__name__}")
    return d


def model_config(model_dir: str | os.PathLike[str]):
    d = read_config(model_dir)
    model_type = d.get("model_type")
    if model_type not in MODELS:
        raise ValueError(f"Unsupported model_type {model_type!r} in {model_dir}; supported: {sorted(MODELS)}")
    return MODELS[model_type][0].from_dict(d)


def model_class(config) -> type:
    return DeepseekV41ForCausalLM if isinstance(config, DeepseekV41ModelConfig) else DeepseekV4ForCausalLM


def checkpoint_naming(config) -> CheckpointNaming:
    """Maps checkpoint names onto the model's: V4 ships in three namings, V4.1 in DeepSeek's own only."""
    if isinstance(config, DeepseekV41ModelConfig):  # the DSpark stages (mtp.*) are the drafter's, the vision
        # encoder's tensors its own loader's (``vision_weights``)
        return naming(lambda name: None if name.startswith(("mtp.", "model.mtp.")) or is_vision_tensor(name)
                      else name.removeprefix("model."))
    return naming()
