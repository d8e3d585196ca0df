"""Gather the per-request sampling parameters of a step into the sampler's batch tensors."""

from __future__ import annotations

import torch

from deepinfer.core.request import Request
from deepinfer.plugins.interfaces import SamplingBatch

# Each of a prompt's n samples gets its own noise key: sample i uses seed + i * GOLDEN (mod 2**63),
# so sample 0 keeps the user's seed and the keys of different samples are far apart.
GOLDEN = 0x9E3779B97F4A7C15


def _sample_seed(request: Request) -> int:
    seed = request.params.seq_seed
    return -1 if seed is None else (seed + request.sample_index * GOLDEN) % 2**63


def _blocked(request: Request) -> list[int]:
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        return []
    stops = list(params.stop_token_ids or ())
    return stops if params.ignore_eos else stops + list(request.eos_token_ids)


def build_sampling_batch(requests: list[Request], vocab_size: int, device) -> SamplingBatch:
    params = [r.params for r in requests]

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    asked = [p.logprobs for p in params if p.logprobs is not None]
    penalised = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
    return SamplingBatch(
        temperature=column([p.temperature for p in params], torch.float32),
        top_k=column([max(p.top_k, 0) for p in params], torch.int64),
        top_p=column([p.top_p for p in params], torch.float32),
        min_p=column([p.min_p for p in params], torch.float32),
        presence_penalty=column([p.presence_penalty for p in params], torch.float32),
        frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
        repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
        seeds=column([_sample_seed(r) for r in requests], torch.int64),
        positions=column([r.num_output_tokens for r in requests], torch.int64),
        prompt_token_ids=[r.prompt_token_ids for r in requests] if penalised else [],
        output_token_ids=[r.output_token_ids for r in requests] if penalised else [],
        blocked_token_ids=[_blocked(r) for r in requests],
        num_logprobs=max((vocab_size if n == -1 else n for n in asked), default=0),
        all_greedy=all(p.temperature == 0 for p in params),
        any_penalties=penalised,
    )
