"""The ``deepinfer_drafter`` hook: DSpark drafts for DeepSeek-V4.1 checkpoints that ship draft stages, classic MTP
drafts for DeepSeek-V4 checkpoints that ship an MTP layer."""

from __future__ import annotations

import torch

from deepinfer.runtime.linear import cast_floating
from deepinfer.loading.model_source import resolve_model_dir
from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.models.deepseek_v4.model import keeps_fp32 as v4_keeps_fp32
from deepinfer.models.deepseek_v4.mtp import MTPLayer
from deepinfer.models.deepseek_v41.config import DeepseekV41ModelConfig
from deepinfer.models.deepseek_v41.dspark import DSparkDraft
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM, keeps_fp32
from deepinfer.models.contract import DraftContext
from deepinfer.loading.draft_vocab import read_draft_vocab
from deepinfer.loading.model_loader import load_part
from deepinfer.logger import init_logger
from deepinfer.plugins.hookspecs import hookimpl
from deepinfer_mtp.dspark_drafter import DSparkDrafter
from deepinfer_mtp.mtp_drafter import MTPDrafter

logger = init_logger(__name__)


def _draft_stage_name(name: str) -> str | None:
    """Checkpoint ``mtp.{i}.*`` read as the draft's ``layers.{i}.*``; every other tensor skipped."""
    return "layers." + name.removeprefix("mtp.") if name.startswith("mtp.") else None


def _mtp_layer_name(name: str) -> str | None:
    """Checkpoint ``mtp.0.*`` read as ``layers.0.*`` (per-expert tensors are named under ``layers.{i}``); every
    other tensor skipped (the reference uses the first MTP layer only)."""
    return "layers.0." + name.removeprefix("mtp.0.") if name.startswith("mtp.0.") else None


@hookimpl
def deepinfer_drafter(config, context):
    varlen = config.enable_mtp_varlen
    if varlen is None:  # unset: no speculative decoding (1: confidence-scheduled lengths, 0: fixed length)
        return None
    switch = f"DEEPINFER_ENABLE_MTP_VARLEN={int(varlen)}"
    c = context.config
    # the switch asks for drafts: a model that cannot have them is an error, not a silent run without speculation
    if isinstance(c, DeepseekV41ModelConfig):
        return _dspark(config, context, c, switch)
    if isinstance(c, DeepseekV4ModelConfig):
        return _mtp(config, context, c, switch)
    raise ValueError(f"{switch}: drafts serve DeepSeek-V4 (classic MTP) and V4.1 (DSpark) models, not "
                     f"{type(c).__name__}. Unset it for this model")


def _refuse_dummy(config, switch: str) -> None:
    # synthetic acceptance (benchmarks only) decides acceptance without the drafts' values: random draft weights
    # then cost what real ones do, which is all such a benchmark measures of them
    if config.load_format == "dummy" and getattr(config, "synthetic_acceptance_length", None) is None:
        raise ValueError(f"{switch} with load_format='dummy': random draft weights would draft nothing useful. "
                         "Load real weights, set synthetic_acceptance_length (benchmarks only), or unset it")


def _dspark(config, context: DraftContext, c: DeepseekV41ModelConfig, switch: str) -> DSparkDrafter:
    if not c.num_nextn_predict_layers or not c.dspark:
        raise ValueError(f"{switch}: this checkpoint has no DSpark draft stages (num_nextn_predict_layers is 0). "
                         "Unset it for this model")
    _refuse_dummy(config, switch)
    backends = context.backends
    with torch.device("meta"):
        draft = DSparkDraft(c, context.rotary, backends.attention, backends.moe, backends.mhc)
    cast_floating(draft, context.dtype, keeps_fp32)
    load_part(draft, c, resolve_model_dir(config.model), DeepseekV41ForCausalLM.checkpoint_name, _draft_stage_name,
              backends.linear, context.device, config.quantization, config.load_format, config.seed)
    draft.requires_grad_(False)
    vocabulary = None
    if config.draft_vocab is not None:
        vocabulary = read_draft_vocab(config.draft_vocab, c.vocab_size)
        logger.info("DSpark drafts from %d of the vocabulary's %d tokens (draft_vocab %s)", len(vocabulary),
                    c.vocab_size, config.draft_vocab)
    return DSparkDrafter(context, draft, config.max_num_seqs, vocabulary)


def _mtp(config, context: DraftContext, c: DeepseekV4ModelConfig, switch: str) -> MTPDrafter:
    if not c.num_nextn_predict_layers:
        raise ValueError(f"{switch}: this checkpoint has no MTP layer (num_nextn_predict_layers is 0). Unset it "
                         "for this model")
    _refuse_dummy(config, switch)
    if config.draft_vocab is not None:
        raise ValueError(f"draft_vocab={str(config.draft_vocab)!r} (DEEPINFER_DRAFT_VOCAB) restricts DSpark drafts "
                         "(DeepSeek-V4.1); this V4 checkpoint drafts with classic MTP, which takes none. Unset it")
    backends = context.backends
    holder = torch.nn.Module()
    with torch.device("meta"):
        holder.layers = torch.nn.ModuleList([MTPLayer(c, context.rotary, backends.attention, backends.moe,
                                                      backends.mhc)])
    cast_floating(holder, context.dtype, v4_keeps_fp32)
    load_part(holder, c, resolve_model_dir(config.model), DeepseekV4ForCausalLM.checkpoint_name, _mtp_layer_name,
              backends.linear, context.device, config.quantization, config.load_format, config.seed)
    holder.requires_grad_(False)
    return MTPDrafter(context, holder.layers[0], config.max_num_seqs, config.num_speculative_tokens)
