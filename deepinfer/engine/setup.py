"""Building an engine's parts, each from the configuration and the parts before it: backends, feature plugins'
offers (checked against the model), caches and scheduler, CUDA graphs and the step mode.

Every offer the engine cannot honour is an error here, before the first step, never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.runtime.block_manager import BlockManager
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.encoder_cache import EncoderCache
from deepinfer.loading.model_loader import load_vision_encoder
from deepinfer.models.deepseek_v41.vision import VisionEncoder
from deepinfer.runner.cuda_graphs import DecodeGraphs
from deepinfer.runner.forward_batch import ForwardBatchBuilder
from deepinfer.runtime.kv_cache import KVCache, bytes_per_block
from deepinfer.engine.overlapped_speculation import OverlappedSpeculation
from deepinfer.engine.scheduler import Scheduler, SchedulerLimits
from deepinfer.engine.speculation import Speculator
from deepinfer.engine.steps import DecodeSteps, SpeculativeSteps, StepContext, StepMode
from deepinfer.logger import init_logger
from deepinfer.models.contract import DraftContext
from deepinfer.plugins.interfaces import AttentionBackend, PrefillTruncation, Sampler
from deepinfer.plugins.manager import call_all, checked, select_backend, select_optional_backend

logger = init_logger(__name__)


def backend(hook_name: str, config: EngineConfig, device: torch.device):
    """The backend that serves ``hook_name`` on ``device``, checked against its protocol."""
    found, _ = checked(hook_name, select_backend(hook_name, config=config, device=device))
    return found


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def check_batch_invariant(**backends) -> None:
    variant = [f"{kind} backend {backend.name!r}" for kind, backend in backends.items()
               if not getattr(backend, "batch_invariant", False)]
    if variant:
        raise ValueError(f"DEEPINFER_BATCH_INVARIANT=1, but the {', '.join(variant)} do not declare "
                         "batch_invariant = True (a row's result could depend on its batch mates); install or select "
                         "backends that do")


def graph_blockers(backends: dict, model, expert_parallel, context) -> list[str]:
    """Why decode steps could not be captured in CUDA graphs (nothing: they can)."""
    blockers = [f"{kind} backend {b.name} may synchronise with the host" for kind, b in backends.items()
                if not b.graph_safe]
    if model.graph_blocker:
        blockers.append(model.graph_blocker)
    if expert_parallel is not None:
        blockers.append("expert parallelism reads each token exchange's sizes on the host")
    if context is not None:
        blockers.append("context parallelism splits each step's tokens by the step's requests")
    return blockers


def speculator(config: EngineConfig, model, max_model_len: int) -> Speculator | None:
    """Speculative decoding, if a drafter plugin offers it for ``model``."""
    offer = checked("deepinfer_drafter", select_optional_backend("deepinfer_drafter", config=config,
                                                                 context=DraftContext.of(model)))
    if offer is None:
        if config.synthetic_acceptance_length is not None:
            raise ValueError(f"synthetic_acceptance_length={config.synthetic_acceptance_length} needs speculative "
                             "decoding, and no drafter plugin serves this model with these arguments (set "
                             "enable_mtp_varlen to True or False, with features/mtp installed)")
        if config.draft_vocab is not None:  # like DEEPINFER_USE_NEXTN_DECODE, a detail of drafting: unused here
            logger.warning("draft_vocab=%s (DEEPINFER_DRAFT_VOCAB) is unused: no drafter serves this engine "
                           "(speculative decoding is off)", config.draft_vocab)
        return None
    if config.synthetic_acceptance_length is not None:
        logger.warning("synthetic_acceptance_length=%s (benchmarks only): drafts are accepted at random for that "
                       "mean acceptance length, so outputs are NOT the target model's (and no draft is cut for its "
                       "confidence, which says nothing of a drawn acceptance)",
                       config.synthetic_acceptance_length)
    lengths = "fixed length"
    if config.enable_mtp_varlen:
        lengths = ("confidence-scheduled lengths, each step's length measured (speculation_policy='measured': "
                   "plain decoding where drafts do not pay)" if config.speculation_policy == "measured" else
                   "confidence-scheduled lengths, load-based floor (speculation_policy='floor')")
    logger.info("speculative decoding: drafter %s (plugin %s), up to %d drafts per step, %s", offer[0].name,
                offer[1], config.num_speculative_tokens, lengths)
    return Speculator(offer[0], config.num_speculative_tokens, config.enable_mtp_varlen,
                      config.max_num_batched_tokens, max_model_len, config.synthetic_acceptance_length,
                      measured_policy=config.speculation_policy == "measured")


def prefill_truncation(config: EngineConfig, model_config, model, max_model_len: int,
                       speculation: Speculator | None) -> PrefillTruncation | None:
    """SWA bounded replay's policy, checked against the model and the longest backtrack: after a prefill the
    decoder layers' windows must hold every row a later step reads, even once drafts are rolled back."""
    offer = checked("deepinfer_prefill_truncation", select_optional_backend(
        "deepinfer_prefill_truncation", config=config, model_config=model_config))
    if offer is None:
        return None
    policy, plugin = offer
    if model.decoder_start is None:
        raise ValueError(
            f"plugin {plugin} offers prefill truncation (SWA bounded replay), but {type(model).__name__} "
            "has no window-only decoder layers: each of its layers keeps full-context state, so running one "
            "on a suffix would change every later token. It applies to DeepSeek-V4.1; unset "
            "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE for this model"
        )
    window = model_config.window
    backtrack = speculation.max_drafts if speculation is not None else 0
    kept = max_model_len - policy.replay_start(max_model_len)
    if kept < window + backtrack:
        raise ValueError(
            f"prefill truncation ({policy.name}) replays the last {kept} prompt tokens, but the suffix must "
            f"cover the sliding window W={window} plus the longest backtrack B={backtrack} (B is "
            "DEEPINFER_USE_NEXTN_DECODE with speculative decoding on, else 0): set "
            f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS >= {window + backtrack}"
        )
    logger.info("prefill truncation: %s (plugin %s); decoder layers %d-%d replay each prompt's last %d tokens",
                policy.name, plugin, model.decoder_start, model_config.num_layers - 1, kept)
    return policy


def step_contexts(config: EngineConfig, device: torch.device) -> list:
    contexts = call_all("deepinfer_step_context", config=config, device=device)
    for context in contexts:
        logger.info("every step runs inside %s", getattr(context, "name", type(context).__name__))
    return contexts


@dataclass(slots=True)
class Caches:
    block_size: int
    cache: KVCache
    blocks: BlockManager
    scheduler: Scheduler
    batch_builder: ForwardBatchBuilder


def encoder_cache(config: EngineConfig, model_config, model_dir, dtype: torch.dtype, device: torch.device
                  ) -> EncoderCache | None:
    """DeepSeek-V4.1's vision encoder on ``device`` and the cache of its outputs (room for the spans of 16 images
    of the most tokens one may take); None for a checkpoint without a vision tower."""
    vision = getattr(model_config, "vision_config", None)
    if vision is None:
        return None
    attend = backend("deepinfer_vision_attention_backend", config, device).attention
    if config.load_format == "dummy":
        encoder = VisionEncoder(vision, model_config.hidden_size, dtype, attend)
    else:
        encoder = load_vision_encoder(model_config, Path(model_dir), dtype, attend)
    return EncoderCache(encoder.to(device), device, 16 * vision.max_image_tokens)


def caches(config: EngineConfig, model_config, model, max_model_len: int, device: torch.device,
           attention: AttentionBackend, image_rows=None) -> Caches:
    """The paged caches sized from the configuration, their block manager, the scheduler over them, and the
    step-input builder that addresses them (``image_rows``: where it takes a step's image embeddings)."""
    c = config
    kinds = model.cache_kinds(kv_fp8=c.kv_cache_dtype == "fp8")
    overlaps = model.compressed_ratios()
    ratios = list(overlaps)
    lcm = math.lcm(*ratios) if ratios else 1
    block_size = c.block_size or lcm * max(1, 64 // lcm)
    if block_size % lcm:
        raise ValueError(f"block_size ({block_size}) must be a multiple of every compression ratio {sorted(ratios)}")
    per_block = {k.name: bytes_per_block(k, block_size) for k in kinds}
    full = [k for k in kinds if k.keep_all]
    tokens = c.num_cache_tokens
    if tokens is None:
        budget = c.kv_cache_memory_gb * 2**30
        tokens = int(budget // max(1, sum(per_block[k.name] for k in full)) * block_size)
        tokens = min(tokens, c.max_num_seqs * max_model_len)
    blocks = {}
    for kind in kinds:
        if kind.keep_all:
            blocks[kind.name] = -(-tokens // block_size)
        else:
            # every running request keeps its look-back plus the block being written;
            # the step's new tokens may add blocks on top of that
            reach = -(-(kind.back + kind.align) // block_size) + 1
            blocks[kind.name] = c.max_num_seqs * reach + -(-c.max_num_batched_tokens // block_size) + c.max_num_seqs
    cache = KVCache(kinds, blocks, block_size, device)
    manager = BlockManager(kinds, blocks, block_size, c.enable_prefix_caching)
    limits = SchedulerLimits(c.max_num_seqs, c.max_num_batched_tokens, c.enable_chunked_prefill, max_model_len)
    rows = {k.name: cache.rows_per_block(k.name) for k in kinds}
    # the attention backend also derives padded steps' cache slots
    builder = ForwardBatchBuilder(model_config.window, overlaps, block_size, rows, device, model.token_history,
                                  model.host_inputs, attention, image_rows)
    logger.info("cache: %d tokens of full-context state, block size %d, %.1f MiB", tokens, block_size,
                cache.nbytes() / 2**20)
    return Caches(block_size, cache, manager, Scheduler(limits, manager), builder)


def decode_graphs(config: EngineConfig, model, built: Caches, device: torch.device, max_model_len: int,
                  speculation: Speculator | None, blockers: list[str]) -> DecodeGraphs | None:
    """The decode steps' CUDA graphs, where they can run; None where every step runs eagerly."""
    c = config
    # with drafts, a request's step holds its last token and up to max_drafts drafts
    rows = 1 + (speculation.max_drafts if speculation is not None else 0)
    if c.cuda_graphs == "padded-eager":  # nothing is captured, so nothing that blocks a capture applies
        graphs = DecodeGraphs(model, built.cache, built.batch_builder, c.max_num_seqs, max_model_len, capture=False,
                              tokens_per_request=rows)
        logger.info("decode steps of up to %d requests are padded as CUDA graphs replay them, and run eagerly "
                    "(cuda_graphs='padded-eager')", graphs.sizes[-1])
        return graphs
    if device.type != "cuda" or c.enforce_eager:
        return None
    if blockers:
        logger.warning("CUDA graphs off: %s", "; ".join(blockers))
        return None
    graphs = DecodeGraphs(model, built.cache, built.batch_builder, c.max_num_seqs, max_model_len,
                          tokens_per_request=rows)
    logger.info("decode steps of up to %d requests replay CUDA graphs (enforce_eager=True turns them off)",
                graphs.sizes[-1])
    drafter = speculation.drafter if speculation is not None else None
    if hasattr(drafter, "use_cuda_graphs"):
        drafter.use_cuda_graphs(graphs.sizes)
    return graphs


def step_mode(context: StepContext, speculation: Speculator | None, asynchronous: bool, sampler: Sampler
              ) -> StepMode:
    """How steps run (``engine/steps.py``): with asynchronous scheduling, speculative steps overlap the host only
    where the drafter and the sampler can stay on the device."""
    if speculation is None:
        return DecodeSteps(context, asynchronous)
    verification = SpeculativeSteps(context, speculation)
    if context.runner.graphs is not None:  # padded steps cost the same for every draft length but none
        speculation.policy_choices = (0, speculation.max_drafts)
    if not asynchronous:
        return verification
    drafter = speculation.drafter
    if not (hasattr(drafter, "propose_on_device") and hasattr(drafter, "device_slots")):
        logger.info("speculative steps wait for the host (asynchronous scheduling pauses): drafter %s drafts "
                    "only from the host's tokens (it has no propose_on_device and device_slots)", drafter.name)
        return verification
    if not getattr(sampler, "graph_safe", False):
        logger.info("speculative steps wait for the host (asynchronous scheduling pauses): sampler %s cannot "
                    "be captured in a CUDA graph (graph_safe)", sampler.name)
        return verification
    if context.runner.graphs is None:  # a step corrected on the device is a padded one: only replayed steps are
        logger.info("speculative steps wait for the host: they overlap it only where verification steps replay "
                    "CUDA graphs, not here")
    else:
        logger.info("speculative steps overlap the host in steady decoding (engine/overlapped_speculation.py)")
    return OverlappedSpeculation(context, verification)
