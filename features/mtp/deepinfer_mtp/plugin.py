"""The ``deepinfer_drafter`` hook: a DSpark drafter for DeepSeek-V4.1 checkpoints that ship draft stages."""

from __future__ import annotations

import torch

from deepinfer import envs
from deepinfer.core.linear import cast_floating
from deepinfer.core.model_source import resolve_model_dir
from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
from deepinfer.models.deepseek_v41.dspark import DSparkDraft
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM, keeps_fp32
from deepinfer.models.loader import load_part
from deepinfer.plugins.hookspecs import hookimpl
from deepinfer_mtp.dspark_drafter import DSparkDrafter

def _draft_stage_name(name: str) -> str | None:
    """Checkpoint ``mtp.{i}.*`` read as the draft's ``layers.{i}.*``; every other tensor skipped."""
    return "layers." + name.removeprefix("mtp.") if name.startswith("mtp.") else None


@hookimpl
def deepinfer_drafter(config, model):
    if not envs.get().DEEPINFER_ENABLE_MTP_VARLEN:  # the spec's switch for DSpark drafting and its verification
        return None
    c = getattr(model, "config", None)
    # DEEPINFER_ENABLE_MTP_VARLEN=1 asks for DSpark drafts: a model that cannot have them is an error, not a
    # silent run without speculation
    if not isinstance(c, DeepseekV41ModelConfig):
        raise ValueError("DEEPINFER_ENABLE_MTP_VARLEN=1: DSpark drafts serve DeepSeek-V4.1 checkpoints; classic MTP "
                         "for the V4 family is not built yet. Unset it for this model")
    if not c.num_nextn_predict_layers or not c.dspark:
        raise ValueError("DEEPINFER_ENABLE_MTP_VARLEN=1: this checkpoint has no DSpark draft stages "
                         "(num_nextn_predict_layers is 0). Unset it for this model")
    if config.load_format == "dummy":
        raise ValueError("DEEPINFER_ENABLE_MTP_VARLEN=1 with load_format='dummy': random draft stages would draft "
                         "nothing useful. Load real weights or unset it")
    device = model.embed.weight.device
    backends = model.backends
    with torch.device("meta"):
        draft = DSparkDraft(c, model.rotary_main, backends.attention, backends.moe, backends.mhc)
    cast_floating(draft, model.dtype, keeps_fp32)
    load_part(draft, c, resolve_model_dir(config.model), DeepseekV41ForCausalLM.checkpoint_name, _draft_stage_name,
              backends.linear, device, config.quantization)
    draft.requires_grad_(False)
    return DSparkDrafter(model, draft)
