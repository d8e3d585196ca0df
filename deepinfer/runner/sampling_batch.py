"""Gather the per-request sampling parameters of a step into the sampler's batch tensors."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from deepinfer.runtime.request import Request
from deepinfer.runtime.transfer import to_device
from deepinfer.plugins.interfaces import SamplingBatch

# Each of a prompt's n samples gets its own noise key: sample i uses seed + i * GOLDEN (mod 2**63),
# so sample 0 keeps the user's seed and the keys of different samples are far apart.
GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """What the host knows of a batch's parameters and a sampler branches on (``SamplingBatch``'s flags): a
    captured sampler's graph is only valid for batches with the same flags."""

    num_logprobs: int
    all_greedy: bool
    any_top_k_top_p: bool
    any_seeded: bool
    any_logprobs: bool

    @staticmethod
    def of(params: list, vocab_size: int) -> "SamplingFlags":
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingFlags(num_logprobs=max((vocab_size if n == -1 else n for n in asked), default=0),
                             all_greedy=all(p.temperature == 0 for p in params),
                             any_top_k_top_p=any(0 < p.top_k < vocab_size or p.top_p < 1 for p in params),
                             any_seeded=any(p.seq_seed is not None for p in params),
                             any_logprobs=bool(asked))


def sample_seed(request: Request) -> int:
    seed = request.params.seq_seed
    return -1 if seed is None else (seed + request.sample_index * GOLDEN) % 2**63


def _blocked(request: Request, output_index: int) -> list[int]:
    params = request.params
    if output_index >= params.min_tokens:
        return []
    stops = list(params.stop_token_ids or ())
    return stops if params.ignore_eos else stops + list(request.eos_token_ids)


def build_sampling_batch(rows: list[tuple[Request, int]], vocab_size: int, device) -> SamplingBatch:
    """One row per (request, j): the token after the request's output plus its first ``j`` drafts (``j`` = 0
    without speculative decoding), sampled as that output position is: its noise, penalties and blocking."""
    requests = [r for r, _ in rows]
    params = [r.params for r in requests]
    index = [r.num_output_tokens + j for r, j in rows]  # the output position each row samples
    # one host-to-device copy per step (both dtypes' bytes in one buffer, viewed apart on the device) rather than one
    # per parameter, not waiting for the device: with asynchronous scheduling it is still running the previous step
    # built through numpy: torch.tensor on nested Python numbers costs several times more
    floats = torch.from_numpy(np.array([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                         p.repetition_penalty] for p in params], dtype=np.float32).T.copy())
    ints = torch.from_numpy(np.array([[max(p.top_k, 0), sample_seed(r), i] for p, r, i in zip(params, requests, index)],
                                     dtype=np.int64).T.copy())
    packed = to_device(torch.cat([ints.view(-1).view(torch.uint8), floats.view(-1).view(torch.uint8)]), device)
    split = ints.numel() * ints.element_size()  # the int64 rows first: the float32 rows after them stay aligned
    ints = packed[:split].view(torch.int64).view(ints.shape)
    floats = packed[split:].view(torch.float32).view(floats.shape)
    penalised = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
    return sampling_batch(floats[0], ints[0], floats[1], floats[2], ints[1], ints[2],
                          SamplingFlags.of(params, vocab_size), penalties=(floats[3], floats[4], floats[5]),
                          any_penalties=penalised,
                          prompt_token_ids=[r.prompt_token_ids for r in requests] if penalised else [],
                          output_token_ids=[r.output_token_ids + r.draft_token_ids[:j] for r, j in rows]
                          if penalised else [],
                          blocked_token_ids=[_blocked(r, i) for r, i in zip(requests, index)],
                          logit_bias=[p.logit_bias or {} for p in params] if any(p.logit_bias for p in params) else [])


def sampling_batch(temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   seeds: torch.Tensor, positions: torch.Tensor, flags: SamplingFlags,
                   penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   any_penalties: bool = False, prompt_token_ids: list = (), output_token_ids: list = (),
                   blocked_token_ids: list = (), logit_bias: list = ()) -> SamplingBatch:
    """The sampler's batch of per-row tensors, wherever they are. Without ``penalties`` (presence, frequency,
    repetition) and the host's lists (token ids, blocked tokens, logit biases) nothing in it comes from the host,
    so a graph can hold the sampler that reads it (the overlapped speculative steps build it so, from values
    already on the device)."""
    if penalties is None:
        none = torch.zeros_like(temperature)
        penalties = none, none, none + 1
    presence, frequency, repetition = penalties
    return SamplingBatch(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
                         frequency_penalty=frequency, repetition_penalty=repetition, seeds=seeds, positions=positions,
                         prompt_token_ids=list(prompt_token_ids), output_token_ids=list(output_token_ids),
                         blocked_token_ids=list(blocked_token_ids), logit_bias=list(logit_bias),
                         any_penalties=any_penalties,
                         **asdict(flags))


def padded_sampling_rows(requests: list, pad: int) -> tuple[list[list[float]], list[list[int]]]:
    """What a graph's tail reads to sample, per request and for ``pad`` padding requests (greedy, unseeded): the
    rows [temperature, top_p, min_p] and [top_k, seed, prompt length] (a row at position p samples output
    position p + 1 - the prompt's length). Tails add rows of their own after these."""
    params = [r.params for r in requests]
    floats = [[p.temperature for p in params] + [0.0] * pad, [p.top_p for p in params] + [1.0] * pad,
              [p.min_p for p in params] + [0.0] * pad]
    ints = [[max(p.top_k, 0) for p in params] + [0] * pad, [sample_seed(r) for r in requests] + [-1] * pad,
            [len(r.prompt_token_ids) for r in requests] + [0] * pad]
    return floats, ints
