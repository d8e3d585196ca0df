"""The engine: built from plugins (``engine/setup.py``), then stepping the scheduler through its step mode."""

from __future__ import annotations

import contextlib
import time

import torch

from deepinfer.engine import setup
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.feature_flags import check_feature_plugins
from deepinfer.runner import cuda_graphs
from deepinfer.runner.model_runner import ModelRunner
from deepinfer.loading.model_source import resolve_model_dir
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.overlapped_speculation import OverlappedSpeculation
from deepinfer.engine.image_inputs import prepare_images
from deepinfer.runtime.images import ImageSpan
from deepinfer.runtime import kernel_compiles
from deepinfer.runtime.request import Request
from deepinfer.runtime.latency_histograms import RequestLatencies
from deepinfer.runtime.step_metrics import EngineTotals, StepClock, StepMetrics
from deepinfer.engine.steps import StepContext
from deepinfer.loading.tokenizer import load_tokenizer
from deepinfer.logger import init_logger
from deepinfer.loading.model_loader import load_model
from deepinfer.loading.model_registry import model_config
from deepinfer.parallel.context_parallel import ContextParallel
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.parallel.ranks import Ranks
from deepinfer.plugins.manager import call_all, checked, load_plugins, select_optional_backend

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, ranks: Ranks | None = None):
        """``ranks``: this process's place in a parallel job (``deepinfer.parallel``); each rank's engine owns its
        own requests and caches."""
        self.config = config
        kernel_compiles.start_counting()
        load_plugins()
        check_feature_plugins(config)
        call_all("deepinfer_configure_engine", config=config)
        model_dir = resolve_model_dir(config.model)
        self.model_config = model_config(model_dir)
        self.tokenizer = load_tokenizer(config.tokenizer or model_dir)
        self.device = ranks.device if ranks is not None else config.torch_device()
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

        attention = setup.backend("deepinfer_attention_backend", config, self.device)
        self.attention = attention  # it also derives padded steps' cache slots
        moe = setup.backend("deepinfer_moe_backend", config, self.device)
        linear = setup.backend("deepinfer_linear_backend", config, self.device)
        mhc = setup.backend("deepinfer_mhc_backend", config, self.device)
        self.sampler = setup.backend("deepinfer_sampler", config, self.device)
        if config.batch_invariant:
            setup.check_batch_invariant(attention=attention, moe=moe, linear=linear, mhc=mhc, sampler=self.sampler)
        dtype = config.torch_dtype(self.model_config.dtype)
        self.expert_parallel = ExpertParallel.for_engine(config, self.model_config, ranks)
        start = time.perf_counter()
        self.model = load_model(self.model_config, model_dir, attention=attention, moe=moe, linear=linear, mhc=mhc,
                                dtype=dtype, device=self.device, tokenizer=self.tokenizer,
                                quantization=config.quantization, load_format=config.load_format, seed=config.seed,
                                expert_parallel=self.expert_parallel, engram_tables=config.engram_tables,
                                keep_features=config.enable_mtp_varlen is not None)
        logger.info("loaded %s (%s, %s, %.2f GiB of weights%s) in %.1f s", model_dir, dtype, self.device,
                    setup.weight_bytes(self.model) / 2**30, ", random: load_format=dummy"
                    if config.load_format == "dummy" else "", time.perf_counter() - start)
        self.context = ContextParallel(ranks) if config.context_parallel_size > 1 else None
        self.graph_blockers = setup.graph_blockers({"attention": attention, "moe": moe, "linear": linear,
                                                    "mhc": mhc}, self.model, self.expert_parallel, self.context)
        # speculation first: the truncation's check needs its longest backtrack
        self.speculator = setup.speculator(config, self.model, self.max_model_len)
        self.truncation = setup.prefill_truncation(config, self.model_config, self.model, self.max_model_len,
                                                   self.speculator)
        if self.context is not None and self.speculator is not None:
            raise ValueError("speculative decoding with context_parallel_size > 1 is not supported yet (draft passes "
                             "would need every rank to run them together); unset DEEPINFER_ENABLE_MTP_VARLEN")
        if self.context is not None and self.truncation is not None:
            raise ValueError("SWA bounded replay with context_parallel_size > 1 is not supported yet; unset "
                             "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
        self._step_contexts = setup.step_contexts(config, self.device)
        # DeepSeek-V4.1's vision tower and its outputs by image (None: the checkpoint reads no images)
        self.encoder_cache = setup.encoder_cache(config, self.model_config, model_dir, dtype, self.device)
        built = setup.caches(config, self.model_config, self.model, self.max_model_len, self.device, attention,
                             None if self.encoder_cache is None else self.encoder_cache.step_images)
        self.block_size, self.cache, self.blocks = built.block_size, built.cache, built.blocks
        self.scheduler, self.batch_builder = built.scheduler, built.batch_builder
        self.graphs = setup.decode_graphs(config, self.model, built, self.device, self.max_model_len,
                                          self.speculator, self.graph_blockers)
        self.outputs = OutputProcessor(self.tokenizer, self.model_config.eos_token_id, self.max_model_len)
        self.step_metrics = StepMetrics()
        self.totals = EngineTotals()
        self.latencies = RequestLatencies()  # finished requests' TTFT, TPOT and end-to-end time (/metrics)
        self._clock = StepClock(self.step_metrics, self.device)
        self.runner = ModelRunner(self.model, self.cache, self.batch_builder, self.sampler,
                                  self.model_config.vocab_size, self.device, self._clock, self.graphs, self.context,
                                  self.expert_parallel)
        context = StepContext(self.scheduler, self.runner, self.outputs, self._clock, self.step_metrics, self.totals,
                              self.latencies)
        self.async_scheduling = config.async_scheduling and self.speculator is None
        self.steps = setup.step_mode(context, self.speculator, config.async_scheduling, self.sampler)
        # the overlapped speculative steps, where they run (their launch counts are read by benches and tests)
        self.overlap = self.steps if isinstance(self.steps, OverlappedSpeculation) else None
        self._structured = None  # the structured-outputs plugin, once a request asks for it

    # -- requests -----------------------------------------------------------------------------
    def check_prompt(self, token_ids: list[int], name: str, images: tuple[ImageSpan, ...] = ()) -> None:
        """Refuses (naming it ``name``) a prompt this engine cannot run: empty, no room left to generate, ids outside
        the vocabulary, or image tokens without their images (``images``: the prompt's ``ImageSpan``s). ``LLM``
        asks before it adds any request, ``add_request`` for every one."""
        if not token_ids:
            raise ValueError(f"{name} is empty")
        if len(token_ids) >= self.max_model_len:
            past = [j for j, span in enumerate(images) if span.end >= self.max_model_len]
            where = f" (image {past[0]} reaching position {images[past[0]].end - 1})" if past else ""
            raise ValueError(f"{name} has {len(token_ids)} tokens{where}, max_model_len is {self.max_model_len}")
        vocab = self.model_config.vocab_size
        bad = [(position, t) for position, t in enumerate(token_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token ids outside the vocabulary [0, {vocab}) at (index, id) {bad[:5]}")
        image_token = getattr(self.model_config, "image_token_id", None)
        if image_token is not None and not images and image_token in token_ids:
            raise ValueError(f"{name}: the prompt contains the image token {image_token} but no image was given "
                             "(pass one image per placeholder in multi_modal_data)")

    def prepare_images(self, token_ids: list[int], sources: list, name: str) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """A prompt with one image-token placeholder per image in ``sources`` -> (its token ids with the image
        spans in place, the spans); ValueError names ``name`` and the image."""
        if self.encoder_cache is None:
            raise ValueError(f"{name} image 0: {self.config.model} has no vision tower (config.json vision_config); "
                             "it reads text only")
        return prepare_images(token_ids, sources, self.model_config.vision_config, self.model_config.image_token_id,
                              name)

    def add_request(self, request: Request) -> None:
        self.check_prompt(request.prompt_token_ids, f"request {request.request_id}", request.images)
        if self.truncation is not None:
            request.replay_start = self.truncation.replay_start(len(request.prompt_token_ids))
        if request.params.so_args is not None:  # validated by LLM.generate before any request was added
            request.grammar = self.structured_outputs().matcher(request.params.so_args)
        self.outputs.start(request)
        self.scheduler.add(request)
        self.totals.prompt_tokens += len(request.prompt_token_ids)

    def abort(self, requests: list[Request]) -> None:
        """Ends ``requests`` now (finish_reason "abort"), freeing their cache blocks; those already finished are
        left alone. Called between steps only: a step already in flight (asynchronous scheduling) still has rows
        of them, which the outputs and ``Scheduler.update`` skip as they skip any request found finished early."""
        for request in requests:
            if request.finished:
                continue
            request.detokenizer.finish()
            request.finish_reason, request.stop_reason = "abort", None
            request.metrics.finished_time = time.monotonic()
            self.scheduler.finish(request)
            self.totals.aborted_requests += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.steps.in_flight

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule and launch one forward pass; returns the requests found finished in this call.

        Runs inside every context a plugin gave ``deepinfer_step_context`` (op overrides). How the step runs
        (waiting for its tokens or not, with drafts or not) is the step mode's (``engine/steps.py``)."""
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
            found = checked("deepinfer_logits_processor", select_optional_backend(
                "deepinfer_logits_processor", config=self.config, tokenizer=self.tokenizer,
                vocab_size=self.model_config.vocab_size))
            if found is None:
                raise ValueError("so_args needs the structured-outputs plugin: install features/structured_outputs "
                                 "(distribution deepinfer-structured-outputs)")
            self._structured = found[0]
        return self._structured

    def reset_counters(self) -> None:
        """Zeroes what ``counters`` and ``step_metrics`` have counted of requests and steps (after a warm-up: its
        made-up requests are nobody's); the process's graph captures and kernel builds stay."""
        self.totals.reset()
        self.latencies.reset()
        self.step_metrics.reset()
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.stats.reset()

    def counters(self) -> dict:
        """Totals since the engine started, and the caches' state now: vLLM-style engine counters."""
        counters = {**self.totals.as_dict(), "preemptions": self.scheduler.num_preemptions,
                    # the process's CUDA-graph captures (seconds each): one inside a timed run explains a stall
                    "cuda_graph_captures": cuda_graphs.captures,
                    "kernel_compiles": kernel_compiles.count(),  # Triton's, likewise (runtime/kernel_compiles.py)
                    "running": len(self.scheduler.running),
                    "waiting": len(self.scheduler.waiting),
                    "cache_usage": {kind: round(used, 4) for kind, used in self.blocks.usage().items()},
                    "histograms": self.latencies.as_dict()}
        if self.encoder_cache is not None:
            counters |= {"encoder_cache_hits": self.encoder_cache.hits, "images_encoded": self.encoder_cache.misses}
        if self.speculator is not None:
            stats = self.speculator.stats
            counters |= {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                         "num_accepted_tokens": stats.num_accepted_tokens}
        return counters
