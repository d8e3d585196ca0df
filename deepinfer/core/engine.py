"""The engine: builds the model and caches from plugins, then steps the scheduler."""

from __future__ import annotations

import contextlib
import itertools
import math
import time

import torch

from deepinfer import envs
from deepinfer.core.block_manager import BlockManager
from deepinfer.core.config import EngineConfig
from deepinfer.core.cuda_graphs import DecodeGraphs
from deepinfer.core.feature_flags import check_feature_plugins
from deepinfer.core.forward_batch import ForwardBatchBuilder
from deepinfer.core.kv_cache import KVCache, bytes_per_block
from deepinfer.core.model_source import resolve_model_dir
from deepinfer.core.model_runner import ModelRunner
from deepinfer.core.output_processor import OutputProcessor
from deepinfer.core.overlapped_speculation import OverlappedSpeculation
from deepinfer.core.request import Request
from deepinfer.core.scheduler import Scheduler, SchedulerLimits
from deepinfer.core.speculation import Speculator
from deepinfer.core.step_metrics import EngineTotals, StepClock, StepMetrics
from deepinfer.core.steps import DecodeSteps, SpeculativeSteps, StepContext, StepMode
from deepinfer.core.tokenizer import load_tokenizer
from deepinfer.logger import init_logger
from deepinfer.models.loader import load_model
from deepinfer.models.registry import model_config
from deepinfer.parallel.context_parallel import ContextParallel
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.parallel.ranks import Ranks
from deepinfer.plugins.manager import call_all, load_plugins, select_backend, select_optional_backend

logger = init_logger(__name__)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


def _check_batch_invariant(**backends) -> None:
    variant = [f"{kind} backend {backend.name!r}" for kind, backend in backends.items()
               if not getattr(backend, "batch_invariant", False)]
    if variant:
        raise ValueError(f"DEEPINFER_BATCH_INVARIANT=1, but the {', '.join(variant)} do not declare batch_invariant = True "
                         "(a row's result could depend on its batch mates); install or select backends that do")


class LLMEngine:
    def __init__(self, config: EngineConfig, ranks: Ranks | None = None):
        """``ranks``: this process's place in a parallel job (``deepinfer.parallel``); each rank's engine owns its
        own requests and caches."""
        self.config = config
        load_plugins()
        check_feature_plugins()
        call_all("deepinfer_configure_engine", config=config)
        env = envs.get()
        model_dir = resolve_model_dir(config.model)
        self.model_config = model_config(model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.device = ranks.device if ranks is not None else config.torch_device(env.DEEPINFER_ACCELERATOR)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        torch.manual_seed(config.seed)
        if self.device.type == "cpu" and torch.set_flush_denormal(True):
            # Subnormal floats (from sinks, softmax tails, Sinkhorn) make CPU kernels ~100x
            # slower; flushing them to zero changes nothing above 1e-38. Process-wide.
            logger.info("CPU: flushing denormal floats to zero")

        attention, _ = select_backend("deepinfer_attention_backend", config=config, device=self.device)
        self.attention = attention  # it also derives padded steps' cache slots
        moe, _ = select_backend("deepinfer_moe_backend", config=config, device=self.device)
        linear, _ = select_backend("deepinfer_linear_backend", config=config, device=self.device)
        mhc, _ = select_backend("deepinfer_mhc_backend", config=config, device=self.device)
        self.sampler, _ = select_backend("deepinfer_sampler", config=config, device=self.device)
        if env.DEEPINFER_BATCH_INVARIANT:
            _check_batch_invariant(attention=attention, moe=moe, linear=linear, mhc=mhc, sampler=self.sampler)
        dtype = config.torch_dtype(self.model_config.dtype)
        self.expert_parallel = ExpertParallel.for_engine(config, self.model_config, ranks)
        start = time.perf_counter()
        self.model = load_model(self.model_config, model_dir, attention=attention, moe=moe, linear=linear, mhc=mhc,
                                dtype=dtype, device=self.device, tokenizer=self.tokenizer,
                                quantization=config.quantization, load_format=config.load_format, seed=config.seed,
                                expert_parallel=self.expert_parallel)
        logger.info("loaded %s (%s, %s, %.2f GiB of weights%s) in %.1f s", model_dir, dtype, self.device,
                    _weight_bytes(self.model) / 2**30, ", random: load_format=dummy" if config.load_format == "dummy"
                    else "", time.perf_counter() - start)
        self.graph_blockers = [f"{kind} backend {b.name} may synchronise with the host" for kind, b in
                               (("attention", attention), ("moe", moe), ("linear", linear), ("mhc", mhc))
                               if not b.graph_safe]
        if self.model.graph_blocker:
            self.graph_blockers.append(self.model.graph_blocker)
        if self.expert_parallel is not None:
            self.graph_blockers.append("expert parallelism reads each token exchange's sizes on the host")
        self.context = ContextParallel(ranks) if config.context_parallel_size > 1 else None
        if self.context is not None:
            self.graph_blockers.append("context parallelism splits each step's tokens by the step's requests")
        self._set_up_feature_plugins()
        if self.context is not None and self.speculator is not None:
            raise ValueError("speculative decoding with context_parallel_size > 1 is not supported yet (draft passes "
                             "would need every rank to run them together); unset DEEPINFER_ENABLE_MTP_VARLEN")
        if self.context is not None and self.truncation is not None:
            raise ValueError("SWA bounded replay with context_parallel_size > 1 is not supported yet; unset "
                             "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
        self._step_contexts = self._collect_step_contexts()
        self._build_caches()
        self.outputs = OutputProcessor(self.tokenizer, self.model_config.eos_token_id, self.max_model_len)
        self.step_metrics = StepMetrics()
        self.totals = EngineTotals()
        self._clock = StepClock(self.step_metrics, self.device)
        self.runner = ModelRunner(self.model, self.cache, self.batch_builder, self.sampler,
                                  self.model_config.vocab_size, self.device, self._clock, self.graphs, self.context,
                                  self.expert_parallel)
        context = StepContext(self.scheduler, self.runner, self.outputs, self._clock, self.step_metrics, self.totals)
        self.async_scheduling = env.DEEPINFER_ASYNC_SCHEDULING and self.speculator is None
        self.overlap: OverlappedSpeculation | None = None
        if self.speculator is None:
            self.steps: StepMode = DecodeSteps(context, self.async_scheduling)
        else:
            verification = SpeculativeSteps(context, self.speculator)
            self.overlap = self._overlapped_speculation(context, verification, env.DEEPINFER_ASYNC_SCHEDULING)
            self.steps = self.overlap or verification
        self._structured = None  # the structured-outputs plugin, once a request asks for it

    def _overlapped_speculation(self, context: StepContext, verification: SpeculativeSteps,
                                asynchronous: bool) -> OverlappedSpeculation | None:
        if not asynchronous:
            return None
        drafter = self.speculator.drafter
        if not (hasattr(drafter, "propose_on_device") and hasattr(drafter, "device_slots")):
            logger.info("speculative steps wait for the host (asynchronous scheduling pauses): drafter %s drafts "
                        "only from the host's tokens (it has no propose_on_device and device_slots)", drafter.name)
            return None
        if not getattr(self.sampler, "graph_safe", False):
            logger.info("speculative steps wait for the host (asynchronous scheduling pauses): sampler %s cannot "
                        "be captured in a CUDA graph (graph_safe)", self.sampler.name)
            return None
        if self.graphs is None:  # a step corrected on the device is a padded one: only replayed steps are
            logger.info("speculative steps wait for the host: they overlap it only where verification steps replay "
                        "CUDA graphs, not here")
        else:
            logger.info("speculative steps overlap the host in steady decoding (core/overlapped_speculation.py)")
        return OverlappedSpeculation(context, verification, self.max_model_len)

    def _collect_step_contexts(self) -> list:
        contexts = call_all("deepinfer_step_context", config=self.config, device=self.device)
        for context in contexts:
            logger.info("every step runs inside %s", getattr(context, "name", type(context).__name__))
        return contexts

    def _set_up_feature_plugins(self) -> None:
        """Speculative decoding and prefill truncation, if a plugin offers them; an offer this engine cannot
        honour is an error, never silently dropped. Speculation first: the truncation's check needs its
        longest backtrack."""
        self._set_up_speculation()
        self.truncation = self._prefill_truncation()

    def _prefill_truncation(self):
        """SWA bounded replay's policy, checked against the model and the longest backtrack: after a prefill the
        decoder layers' windows must hold every row a later step reads, even once drafts are rolled back."""
        offer = select_optional_backend(
            "deepinfer_prefill_truncation", config=self.config, model_config=self.model_config
        )
        if offer is None:
            return None
        policy, plugin = offer
        if self.model.decoder_start is None:
            raise ValueError(
                f"plugin {plugin} offers prefill truncation (SWA bounded replay), but {type(self.model).__name__} "
                "has no window-only decoder layers: each of its layers keeps full-context state, so running one "
                "on a suffix would change every later token. It applies to DeepSeek-V4.1; unset "
                "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE for this model"
            )
        window = self.model_config.window
        backtrack = self.speculator.max_drafts if self.speculator is not None else 0
        kept = self.max_model_len - policy.replay_start(self.max_model_len)
        if kept < window + backtrack:
            raise ValueError(
                f"prefill truncation ({policy.name}) replays the last {kept} prompt tokens, but the suffix must "
                f"cover the sliding window W={window} plus the longest backtrack B={backtrack} (B is "
                "DEEPINFER_USE_NEXTN_DECODE with speculative decoding on, else 0): set "
                f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS >= {window + backtrack}"
            )
        logger.info("prefill truncation: %s (plugin %s); decoder layers %d-%d replay each prompt's last %d tokens",
                    policy.name, plugin, self.model.decoder_start, self.model_config.num_layers - 1, kept)
        return policy

    def _set_up_speculation(self) -> None:
        self.speculator = None
        offer = select_optional_backend("deepinfer_drafter", config=self.config, model=self.model)
        if offer is not None:
            env = envs.get()
            self.speculator = Speculator(offer[0], env.DEEPINFER_USE_NEXTN_DECODE, env.DEEPINFER_ENABLE_MTP_VARLEN,
                                         self.config.max_num_batched_tokens, self.max_model_len)
            logger.info("speculative decoding: drafter %s (plugin %s), up to %d drafts per step, %s", offer[0].name,
                        offer[1], env.DEEPINFER_USE_NEXTN_DECODE,
                        "confidence-scheduled lengths" if env.DEEPINFER_ENABLE_MTP_VARLEN else "fixed length")

    def _build_caches(self) -> None:
        c, mc = self.config, self.model_config
        kinds = self.model.cache_kinds(kv_fp8=c.kv_cache_dtype == "fp8")
        overlaps = self.model.compressed_ratios()
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
            tokens = min(tokens, c.max_num_seqs * self.max_model_len)
        blocks = {}
        for kind in kinds:
            if kind.keep_all:
                blocks[kind.name] = -(-tokens // block_size)
            else:
                # every running request keeps its look-back plus the block being written;
                # the step's new tokens may add blocks on top of that
                reach = -(-(kind.back + kind.align) // block_size) + 1
                blocks[kind.name] = c.max_num_seqs * reach + -(-c.max_num_batched_tokens // block_size) + c.max_num_seqs
        self.block_size = block_size
        self.cache = KVCache(kinds, blocks, block_size, self.device)
        self.blocks = BlockManager(kinds, blocks, block_size, c.enable_prefix_caching)
        limits = SchedulerLimits(c.max_num_seqs, c.max_num_batched_tokens, c.enable_chunked_prefill, self.max_model_len)
        self.scheduler = Scheduler(limits, self.blocks)
        rows = {k.name: self.cache.rows_per_block(k.name) for k in kinds}
        self.batch_builder = ForwardBatchBuilder(mc.window, overlaps, block_size, rows, self.device,
                                                 self.model.token_history, self.model.host_inputs, self.attention)
        logger.info("cache: %d tokens of full-context state, block size %d, %.1f MiB", tokens, block_size, self.cache.nbytes() / 2**20)
        self.graphs = None
        # with drafts, a request's step holds its last token and up to max_drafts drafts
        rows = 1 + (self.speculator.max_drafts if self.speculator is not None else 0)
        if c.cuda_graphs == "padded-eager":  # nothing is captured, so nothing that blocks a capture applies
            self.graphs = DecodeGraphs(self.model, self.cache, self.batch_builder, c.max_num_seqs, self.max_model_len,
                                       capture=False, tokens_per_request=rows)
            logger.info("decode steps of up to %d requests are padded as CUDA graphs replay them, and run eagerly "
                        "(cuda_graphs='padded-eager')", self.graphs.sizes[-1])
        elif self.device.type == "cuda" and not c.enforce_eager and self.graph_blockers:
            logger.warning("CUDA graphs off: %s", "; ".join(self.graph_blockers))
        elif self.device.type == "cuda" and not c.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.cache, self.batch_builder, c.max_num_seqs, self.max_model_len,
                                       tokens_per_request=rows)
            logger.info("decode steps of up to %d requests replay CUDA graphs (enforce_eager=True turns them off)",
                        self.graphs.sizes[-1])
            drafter = self.speculator.drafter if self.speculator is not None else None
            if hasattr(drafter, "use_cuda_graphs"):
                drafter.use_cuda_graphs(self.graphs.sizes)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if len(request.prompt_token_ids) == 0:
            raise ValueError(f"request {request.request_id}: the prompt is empty")
        if len(request.prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt has {len(request.prompt_token_ids)} tokens, "
                f"max_model_len is {self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request.request_id}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        image_token = getattr(self.model_config, "image_token_id", None)
        if image_token is not None and image_token in request.prompt_token_ids:
            raise NotImplementedError(
                f"request {request.request_id}: the prompt contains the image token {image_token}; image inputs "
                "are not supported yet (DeepSeek-V4.1's vision tower is not implemented)"
            )
        if self.truncation is not None:
            request.replay_start = self.truncation.replay_start(len(request.prompt_token_ids))
        if request.params.so_args is not None:  # validated by LLM.generate before any request was added
            request.grammar = self.structured_outputs().matcher(request.params.so_args)
        self.outputs.start(request)
        self.scheduler.add(request)
        self.totals.prompt_tokens += len(request.prompt_token_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.steps.in_flight

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule and launch one forward pass; returns the requests found finished in this call.

        Runs inside every context a plugin gave ``deepinfer_step_context`` (op overrides). How the step runs
        (waiting for its tokens or not, with drafts or not) is the step mode's (``core/steps.py``)."""
        with contextlib.ExitStack() as stack:
            for context in self._step_contexts:
                stack.enter_context(context)
            finished = self._step()
        if self.expert_parallel is not None:
            self.expert_parallel.step_done()
        return finished

    def _step(self) -> list[Request]:
        self._clock.start()
        return self.steps.step()

    def structured_outputs(self):
        """The structured-outputs plugin's ``LogitsProcessor``, loaded on first use (it reads the tokenizer's
        whole vocabulary once)."""
        if self._structured is None:
            found = select_optional_backend("deepinfer_logits_processor", config=self.config,
                                            tokenizer=self.tokenizer, vocab_size=self.model_config.vocab_size)
            if found is None:
                raise ValueError("so_args needs the structured-outputs plugin: install features/structured_outputs "
                                 "(distribution deepinfer-structured-outputs)")
            self._structured = found[0]
        return self._structured

    def counters(self) -> dict:
        """Totals since the engine started, and the caches' state now: vLLM-style engine counters."""
        counters = {**self.totals.as_dict(), "preemptions": self.scheduler.num_preemptions,
                    "running": len(self.scheduler.running),
                    "waiting": len(self.scheduler.waiting),
                    "cache_usage": {kind: round(used, 4) for kind, used in self.blocks.usage().items()}}
        if self.speculator is not None:
            stats = self.speculator.stats
            counters |= {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                         "num_accepted_tokens": stats.num_accepted_tokens}
        return counters
