"""Test probes into a live engine (not part of the public API)."""

from __future__ import annotations

import torch

from deepinfer.runtime.request import Request
from deepinfer.runtime.scheduled import ScheduledBatch, ScheduledRequest
from deepinfer.models.contract import ModelOutput
from deepinfer.sampling_params import SamplingParams


@torch.inference_mode()
def prefill_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of one uncached prefill through the engine's caches."""
    return llm.engine.model.compute_logits(prefill_output(llm, token_ids).hidden)


@torch.inference_mode()
def prefill_output(llm, token_ids: list[int]) -> ModelOutput:
    """The model's output for one uncached prefill of ``token_ids`` through the engine's caches."""
    engine = llm.engine
    request = Request("probe", 0, None, list(token_ids), SamplingParams(), ())
    if not engine.blocks.reserve(request.tables, 0, len(token_ids)):
        raise RuntimeError(f"no cache blocks left for a {len(token_ids)}-token probe")
    try:
        batch = engine.batch_builder.build(ScheduledBatch([ScheduledRequest.of(request, 0, len(token_ids))]))
        return engine.model(batch, engine.cache)
    finally:
        engine.blocks.free(request.tables)
