"""Reference sampler in plain torch: the behaviour other samplers are tested against.

Order per row: logit bias, blocked tokens, repetition penalty, frequency/presence penalties, then greedy
argmax, or temperature, top-k, top-p, min-p and a Gumbel-max draw. Returned log-probabilities
are those of the raw model distribution (vLLM's default "raw_logprobs").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.runtime.transfer import to_device
from deepinfer.plugins.hookspecs import hookimpl
from deepinfer.plugins.interfaces import SamplerOutput, SamplingBatch


@hookimpl(trylast=True)
def deepinfer_sampler(config, device):
    return TorchSampler()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass(slots=True)
class TorchSampler:
    name: str = "torch-reference"
    batch_invariant: bool = True
    graph_safe: bool = True  # without penalties, blocked tokens or logit biases, whose tensors come from the host
    # ``argmax(dim=-1)`` of fp32 [T, V] logits: a backend plugin passes a faster one (the NVIDIA plugin's Triton
    # kernel), the same function: the first maximal index, a NaN above any number
    greedy: Callable[[torch.Tensor], torch.Tensor] = _argmax

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.any_logprobs else None
        biased = any(batch.logit_bias)
        if biased or any(batch.blocked_token_ids) or batch.any_penalties:  # edited in place: the caller's is left alone
            logits = logits.clone()
            if biased:
                _add_logit_bias(logits, batch.logit_bias)
            _block_tokens(logits, batch.blocked_token_ids)
            if batch.any_penalties:
                _apply_penalties(logits, batch)

        token_ids = self.greedy(logits)
        if not batch.all_greedy:
            sampled = _sample_filtered(logits, batch)
            token_ids = torch.where(batch.temperature == 0, token_ids, sampled)

        top_ids, top_values = _top_logprobs(raw_logprobs, batch.num_logprobs)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=None if raw_logprobs is None else raw_logprobs.gather(1, token_ids[:, None]).squeeze(1),
            top_logprob_ids=top_ids,
            top_logprobs=top_values,
        )


def _flat_index(rows_of_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, id) index pairs of a ragged list of id lists, for scatter-style updates."""
    rows = torch.tensor([row for row, ids in enumerate(rows_of_ids) for _ in ids], dtype=torch.int64)
    cols = torch.tensor(list(itertools.chain.from_iterable(rows_of_ids)), dtype=torch.int64)
    return to_device(rows, device), to_device(cols, device)


def _add_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float]]) -> None:
    rows, cols = _flat_index([list(bias) for bias in logit_bias], logits.device)
    values = torch.tensor([value for bias in logit_bias for value in bias.values()], dtype=logits.dtype)
    logits.index_put_((rows, cols), to_device(values, logits.device), accumulate=True)


def _block_tokens(logits: torch.Tensor, blocked_token_ids: list[list[int]]) -> None:
    if not any(blocked_token_ids):  # the usual case; the index tensors below would cost a host round trip
        return
    rows, cols = _flat_index(blocked_token_ids, logits.device)
    logits[rows, cols] = -math.inf


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Repetition penalty over prompt + output tokens (HF/vLLM rule), then the OpenAI
    frequency/presence penalties over output tokens only."""
    output_counts = torch.zeros_like(logits)
    rows, cols = _flat_index(batch.output_token_ids, logits.device)
    output_counts.index_put_((rows, cols), torch.ones_like(cols, dtype=logits.dtype), accumulate=True)

    seen = output_counts > 0
    rows, cols = _flat_index(batch.prompt_token_ids, logits.device)
    seen[rows, cols] = True
    penalty = batch.repetition_penalty[:, None]
    # Dividing a negative logit would raise its probability, so those are multiplied instead.
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(seen, penalized, logits))

    logits -= batch.frequency_penalty[:, None] * output_counts
    logits -= batch.presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)


def _sample_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    # Greedy rows are sampled too (and discarded) to keep the batch vectorised; temperature 1 keeps them finite.
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    scaled = logits / temperature[:, None]
    keep = _top_k_top_p_mask(scaled, batch.top_k, batch.top_p, batch.any_top_k_top_p)
    # min-p: p_i >= min_p * p_max  <=>  logit_i - logit_max >= log(min_p), no softmax needed.
    min_p_floor = scaled.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
    keep &= scaled >= min_p_floor
    filtered = torch.where(keep, scaled, torch.full_like(scaled, -math.inf))

    seeded = batch.seeds >= 0
    gumbel = _unseeded_gumbel(filtered.shape, filtered.device)
    if batch.any_seeded:  # every row's seeded noise, kept where the row is seeded: no host sync to find them
        seeded_noise = _seeded_gumbel(batch.seeds, batch.positions, filtered.shape[1])
        gumbel = torch.where(seeded.unsqueeze(1), seeded_noise, gumbel)
    # Gumbel-max: argmax(log p + G) is a draw from p; the softmax normaliser is a per-row
    # constant, so the filtered logits serve as well as their log-softmax.
    return (filtered.double() + gumbel).argmax(dim=-1)


def _top_k_top_p_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, active: bool) -> torch.Tensor:
    vocab_size = scaled.shape[1]
    if not active:  # no row filters (known on the host: asking the device would wait for it)
        return torch.ones_like(scaled, dtype=torch.bool)
    k_active = (top_k > 0) & (top_k < vocab_size)
    p_active = top_p < 1  # skipping p = 1 avoids dropping the tail to cumsum rounding

    # Stable sort keeps the choice among tied logits independent of anything but the row.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=scaled.device)[None, :]
    k = torch.where(k_active, top_k, torch.full_like(top_k, vocab_size))
    keep_sorted = rank < k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep_sorted, -math.inf)

    # Keep the smallest head whose mass reaches top_p: a token stays if the mass before it is short of p.
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted &= ~(p_active[:, None] & (mass_before >= top_p[:, None]))
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _unseeded_gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    uniform = torch.rand(shape, dtype=torch.float64, device=device)
    # rand can return exactly 0, whose Gumbel would be -inf; the clamp moves that 2^-53 of mass.
    return -torch.log(-torch.log(uniform.clamp_min(2.0**-53)))


# SplitMix64 constants as signed int64 (torch has no full uint64 arithmetic); two's-complement
# wrap-around makes the products and sums equal to the unsigned ones modulo 2^64.
def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (zero-filling) right shift; ``>>`` on int64 copies the sign bit."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN_GAMMA
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def _seeded_gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [S, V] that is a pure function of (seed, position, token id).

    Only exact int64 arithmetic feeds the uniform, so the noise does not depend on the device,
    the batch, or any generator state.
    """
    row_key = _splitmix64(_splitmix64(seeds) ^ positions)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    bits = _splitmix64(row_key[:, None] ^ token_ids[None, :])
    # 52 random bits -> (k + 0.5) / 2^52, exactly representable and strictly inside (0, 1).
    uniform = (_shift_right(bits, 12).double() + 0.5) / 2.0**52
    return -torch.log(-torch.log(uniform))


def _top_logprobs(raw_logprobs: torch.Tensor, num_logprobs: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if num_logprobs == 0:
        return None, None
    vocab_size = raw_logprobs.shape[1]
    # -1 asks for the whole vocabulary, as SamplingParams.logprobs does.
    k = vocab_size if num_logprobs < 0 else min(num_logprobs, vocab_size)
    values, ids = raw_logprobs.topk(k, dim=-1)
    return ids, values
