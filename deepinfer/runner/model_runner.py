"""The model runner: a scheduled step in, logits and sampled tokens out.

It owns how a step runs: replayed from a CUDA graph where one fits (``runner/cuda_graphs.py``), else eagerly from
the inputs ``ForwardBatchBuilder`` builds (with this rank's share under context parallelism); the vocabulary
projection; grammar masks and the sampler. It books nothing: the step modes (``engine/steps.py``) hand what it
returns to the outputs and to ``Scheduler.update``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.runner.cuda_graphs import DecodeGraphs, StepTail
from deepinfer.runner.forward_batch import ForwardBatchBuilder
from deepinfer.runner.grammar_masks import apply_grammar_masks
from deepinfer.runtime.images import step_image_parts
from deepinfer.runtime.kv_cache import KVCache
from deepinfer.runtime.request import Request
from deepinfer.runner.sampling_batch import build_sampling_batch
from deepinfer.runtime.scheduled import ScheduledBatch
from deepinfer.runner.step_inputs import StepInputs
from deepinfer.runtime.step_metrics import StepClock
from deepinfer.parallel.context_parallel import ContextParallel
from deepinfer.parallel.expert_parallel import ExpertParallel
from deepinfer.plugins.interfaces import Sampler, SamplerOutput


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [sampled rows, vocab] in step order; None where no request samples
    # [rows, F] what the drafter reads of every row (``ModelOutput.features``; a padded step's real rows only)
    features: torch.Tensor | None
    started: torch.cuda.Event | None  # recorded right before the step's first kernel (CUDA only)


@dataclass(slots=True)
class ModelRunner:
    model: torch.nn.Module
    cache: KVCache
    batch_builder: ForwardBatchBuilder
    sampler: Sampler
    vocab_size: int
    device: torch.device
    clock: StepClock
    graphs: DecodeGraphs | None = None
    context: ContextParallel | None = None
    expert_parallel: ExpertParallel | None = None

    def forward(self, scheduled: ScheduledBatch, complete: Callable[[torch.Tensor], None] | None = None
                ) -> ForwardOutput:
        """The step's forward pass and the logits of the rows it samples. ``complete(token_ids)`` is called where
        the forward pass will read the step's token ids, before it runs (asynchronous scheduling writes the
        previous step's sampled tokens there)."""
        clock, started = self.clock, None

        def launch(token_ids: torch.Tensor) -> None:  # the inputs are in place: complete them, time from here
            nonlocal started
            clock.lap("prepare")
            if complete is not None:
                complete(token_ids)
            started = clock.event()

        if self.replays(scheduled):
            logits, features = self.graphs.logits(scheduled, before_launch=lambda inputs: launch(inputs.token_ids))
        else:
            batch = self.batch_builder.build(scheduled)
            if self.context is not None:
                batch.context = self.context.share(scheduled)
            launch(batch.token_ids)
            output = self.model(batch, self.cache)
            features = output.features
            logits = self.model.compute_logits(output.hidden[batch.logits_rows]) if scheduled.sampling else None
        clock.lap("forward")
        return ForwardOutput(logits, features, started)

    def replays(self, scheduled: ScheduledBatch) -> bool:
        """Whether the step runs as a padded (CUDA-graph) step: never one with image rows (a short last prefill
        chunk may fit a graph, which has no place for their embeddings)."""
        if self.graphs is None or not self.graphs.fits(scheduled):
            return False
        return self.batch_builder.image_rows is None or not step_image_parts(scheduled)  # text-only: never asked

    def forward_with_tail(self, scheduled: ScheduledBatch, tail: StepTail, complete: Callable[[StepInputs], None],
                          values_on_device: bool) -> tuple[torch.Tensor, ...]:
        """A padded step whose ``tail`` (device work after the forward pass) runs in the same graph: its outputs
        (``DecodeGraphs.with_tail``)."""
        return self.graphs.with_tail(scheduled, tail, complete, values_on_device=values_on_device)

    def sample(self, logits: torch.Tensor, rows: list[tuple[Request, int]]) -> SamplerOutput:
        """Samples ``rows`` (request, drafts before the row) of ``logits`` after their grammars mask them."""
        apply_grammar_masks(logits, rows)
        return self.sampler.sample(logits, build_sampling_batch(rows, self.vocab_size, self.device))

    def idle(self) -> None:
        """A step with nothing scheduled: under expert parallelism this rank still serves the others' tokens."""
        if self.expert_parallel is not None:
            self.expert_parallel.idle_step(self.model.dtype)

    def needs_host_tokens(self, scheduled: ScheduledBatch) -> bool:
        """Whether this step's inputs need the previous step's token values on the host: Engram's hashes do when
        its tables are gathered on the host, and so do repetition/frequency/presence penalties, which count them."""
        if self.model.needs_host_tokens:
            return True
        return any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                   for p in (r.params for r in scheduled.requests))
