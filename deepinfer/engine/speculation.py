"""Speculative decoding: drafts proposed after a step are verified by the next one, then accepted or rolled back.

A request's drafts ride at the end of its ``token_ids`` (``Request.num_drafts``), so the scheduler, the batch
builder and Engram's token history treat them as the tokens to compute; the step asks for logits at the last real
token and at every draft. Verification then samples each of those rows exactly as decoding without drafts would
sample that position: the same sampler, with the penalties, ``min_tokens`` blocking and ``seq_seed`` noise of the
output position the row stands for. Draft ``j`` is accepted when it equals the token sampled at the row before it;
the tokens emitted are the sampled ones up to and including the first that differs from its draft (or the one after
the last draft: the bonus token). Every emitted token is thus the token non-speculative decoding would sample, given
the same noise: greedy and ``seq_seed`` outputs are identical with speculation on and off, and unseeded outputs have
the same distribution. (This is verification by coupling rather than by Leviathan et al.'s accept/reject ratio; at
temperature > 0 it accepts less often unless the drafter draws its tokens from the same noise.)

Rolling back a rejected draft needs no cache edits: every cache row is addressed by position, so the rows computed
for rejected positions are overwritten when those positions are computed again, and ``num_computed`` stops before
them (a compression window that closed on a rejected token closes again, on the right one, before anything reads
its entry). Prefix caching publishes blocks only up to ``num_computed``.

Synthetic acceptance (``EngineConfig.synthetic_acceptance_length``) is for benchmarks only: the counts are drawn
(``synthetic_accepted``) rather than matched, so outputs are not the target model's.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.engine import draft_policy
from deepinfer.engine.draft_policy import DraftPolicy
from deepinfer.runner import cuda_graphs
from deepinfer.runner.grammar_masks import allowed_drafts
from deepinfer.runtime.request import Request
from deepinfer.logger import init_logger
from deepinfer.plugins.interfaces import ComputedRows, Draft, Drafter

logger = init_logger(__name__)

# the prefix-survival floor of confidence scheduling: a lightly loaded step verifies every draft whose estimated
# chance of being reached and accepted is at least this; the floor rises with the step's load (``survival_floor``)
MIN_SURVIVAL = 0.1
MAX_SURVIVAL = 0.9


def survival_floor(decoding: int, max_drafts: int, max_num_batched_tokens: int) -> float:
    """Confidence scheduling's cut-off for a step of ``decoding`` requests. A decode step that verifies few tokens
    costs what reading the weights costs, so extra rows are nearly free and even unlikely drafts pay; as the rows
    the step would verify approach its token budget (compute-bound), only likely ones do."""
    load = decoding * (1 + max_drafts) / max_num_batched_tokens
    return min(MAX_SURVIVAL, max(MIN_SURVIVAL, load))


# The rules below take tensors wherever they live: the overlapped steps apply them on the device inside a step's
# graph, the synchronous steps to one CPU tensor per step, so both paths follow the same rule by construction.


def verified_lengths(limits: torch.Tensor, confidence: torch.Tensor | None,
                     floor: float | torch.Tensor | None) -> torch.Tensor:
    """How many drafted tokens to verify per request [B]: at most ``limits`` [B]; with a ``floor`` (confidence
    scheduling: a number, or one per request [B]) and ``confidence`` [B, D], the longest prefix whose survival
    (the product of its confidences) stays at or above it."""
    if floor is None or confidence is None:
        return limits
    # at least fp32 (a bf16 product drifts), fp64 kept: the host's confidences are Python floats
    survival = confidence.to(torch.promote_types(confidence.dtype, torch.float32)).cumprod(dim=1)
    if isinstance(floor, torch.Tensor):
        floor = floor.unsqueeze(1)
    return torch.minimum(limits, (survival >= floor).long().cumprod(dim=1).sum(dim=1))


def accepted_counts(drafts: torch.Tensor, sampled: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Leading drafts per request [B] equal to the token sampled at the row before each: ``drafts`` [B, k]
    against ``sampled`` [B, k + 1], only the first ``limits`` [B] drafts counting (the rest are padding or beyond
    what was verified)."""
    k = drafts.shape[1]
    match = (drafts == sampled[:, :k]) & (torch.arange(k, device=drafts.device) < limits.unsqueeze(1))
    return match.long().cumprod(dim=1).sum(dim=1)


def accepted_on_host(drafts: list[list[int]], sampled: list[list[int]]) -> list[int]:
    """``accepted_counts`` of a synchronous step, on its host lists: each request's drafts against its ``sampled``
    rows (one more). The same rule in plain Python: tensors or arrays built from a step's few lists cost 0.08-0.1
    ms a step on the host (measured on a CPU VM and as the H200's synchronous speculative steps' output phase),
    the loop 3 µs; tests/test_speculative_decoding.py checks the two agree."""
    counts = []
    for tokens, row in zip(drafts, sampled):
        count = 0
        while count < len(tokens) and tokens[count] == row[count]:
            count += 1
        counts.append(count)
    return counts


def verified_on_host(drafts: list[Draft], limits: list[int], floor: float | None) -> list[int]:
    """``verified_lengths`` of a synchronous step's drafts, each at most ``limits`` and its own length. Missing
    confidences are padded with 1, which keeps a row's survival: such a draft is cut only by its limit."""
    limits = torch.tensor([min(limit, len(d.token_ids)) for d, limit in zip(drafts, limits)], dtype=torch.int64)
    if floor is None or all(d.confidence is None for d in drafts):
        return limits.tolist()
    confidence = np.ones((len(drafts), max(len(d.confidence or ()) for d in drafts)), dtype=np.float64)
    for row, draft in zip(confidence, drafts):
        if draft.confidence is not None:
            row[:len(draft.confidence)] = draft.confidence
    return verified_lengths(limits, torch.from_numpy(confidence), floor).tolist()


def draft_room(ends, lengths):
    """Drafts worth verifying for requests of ``lengths`` tokens that must end by ``ends`` (``Speculator.end``):
    a step emits at most one token more than it verifies, and never past ``max_tokens`` or ``max_model_len``.
    Tensors on the device (the overlapped tail) or one request's ints on the host (``Speculator.draft``), where
    building tensors each step would cost more than the rule."""
    room = ends - lengths - 1
    return room.clamp_min(0) if isinstance(room, torch.Tensor) else max(room, 0)


# -- synthetic acceptance (benchmarks only) ----------------------------------------------------------------------
# The drafter drafts and the target verifies as always, but how many drafts a step accepts is drawn, not matched,
# so a benchmark can price speculation at an acceptance length the deployment's drafter would reach. The rule: one
# conditional rate p for every position (draft j is accepted, given drafts 0..j-1 were, with probability p), the p
# that makes the expected acceptance length 1 + p + ... + p^k equal the requested L for k drafts. The draws come
# from a counter-based hash of (request key, the step's first position, draft index): no generator state, so the
# same values on any device, inside a CUDA graph, in the synchronous and the overlapped steps alike.

_MASK32 = 0xFFFFFFFF


def synthetic_rate(length: float, max_drafts: int, tolerance: float = 1e-12) -> float:
    """The conditional acceptance rate p with 1 + p + p^2 + ... + p^max_drafts == ``length``, by bisection on
    [0, 1] (the sum rises strictly with p, from 1 at p = 0 to max_drafts + 1 at p = 1)."""
    if not 1 <= length <= max_drafts + 1:
        raise ValueError(f"synthetic acceptance length must be in [1, {max_drafts + 1}] for {max_drafts} drafts "
                         f"(num_speculative_tokens), got {length!r}")
    if length in (1, max_drafts + 1):  # exactly: a bisection's near-0 (near-1) rate would still accept (reject)
        return float(length > 1)
    low, high = 0.0, 1.0
    while high - low > tolerance:
        p = (low + high) / 2
        if sum(p ** i for i in range(max_drafts + 1)) < length:
            low = p
        else:
            high = p
    return (low + high) / 2


def synthetic_key(request: Request) -> int:
    """A request's 32-bit key for synthetic draws (a CRC rather than ``hash``, which Python salts per process): from
    its ``seq_seed`` and sample index when it has a seed, so that runs of the same seeded requests draw the same
    counts (a benchmark's warm-up then meets every batch size its timed run meets, and captures their graphs);
    from its id otherwise."""
    seed = request.params.seq_seed
    origin = f"{request.request_id}:None" if seed is None else f"seed:{seed}"
    return zlib.crc32(f"{origin}:{request.sample_index}".encode())


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # an integer avalanche on values below 2^32 whose products stay below 2^63: exact in int64 on every device
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def synthetic_accepted(keys: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor, rate: float,
                       max_drafts: int) -> torch.Tensor:
    """Drafts accepted per request [B] under synthetic acceptance: each of ``max_drafts`` positions accepted with
    conditional probability ``rate`` (a run of acceptances, stopping at the first rejection), at most ``limits``
    [B] (what was verified). ``keys`` [B] (``synthetic_key``) and ``positions`` [B] (each request's first
    position in the step) pick the draws, so a request's count depends on nothing else in the batch."""
    index = torch.arange(max_drafts, device=keys.device, dtype=torch.int64)
    x = _mix32((keys.to(torch.int64) & _MASK32).unsqueeze(1))
    x = _mix32(x ^ (positions.to(torch.int64) & _MASK32).unsqueeze(1))
    x = _mix32(x ^ index)
    # the top 24 bits: uniform on [0, 1) and exact in float32
    uniform = (x >> 8).to(torch.float32) / float(1 << 24)
    drawn = (uniform < rate).long().cumprod(dim=1).sum(dim=1)
    return torch.minimum(drawn, limits.to(torch.int64))


def drafts_in_accepted_rows(sampled: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``sampled`` [B, k + 1] with row j < ``accepted`` [B] holding draft j (``drafts`` [B, k]): the tokens a step
    emits under synthetic acceptance, the accepted drafts then the target's token at the first rejected row (the
    inputs those drafts were, so the caches, the drafter and the outputs agree on them)."""
    k = drafts.shape[1]
    padded = torch.nn.functional.pad(drafts, (0, sampled.shape[1] - k))
    keep = torch.arange(sampled.shape[1], device=sampled.device) < accepted.unsqueeze(1)
    return torch.where(keep, padded.to(sampled.dtype), sampled)


@dataclass(slots=True)
class SpeculationStats:
    """Engine-wide counters, as vLLM reports them."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = []

    def record(self, request: Request, drafted: int, accepted: int) -> None:
        for stats in (self, request.metrics):
            stats.num_drafts += 1
            stats.num_draft_tokens += drafted
            stats.num_accepted_tokens += accepted
            per_position = stats.accepted_per_position
            per_position.extend([0] * (drafted - len(per_position)))
            for position in range(accepted):
                per_position[position] += 1

    def summary(self) -> str:
        if not self.num_drafts:
            return "speculative decoding: no drafts verified"
        rates = ", ".join(f"{count / self.num_drafts:.3f}" for count in self.accepted_per_position)
        return (f"speculative decoding since the engine started: {self.num_drafts} drafts, {self.num_draft_tokens} draft tokens, "
                f"{self.num_accepted_tokens} accepted; mean acceptance length "
                f"{1 + self.num_accepted_tokens / self.num_drafts:.3f}; acceptance rate by position [{rates}]")


class Speculator:
    """Asks the drafter for the requests that decode next and sizes what the next step verifies."""

    def __init__(self, drafter: Drafter, max_drafts: int, confidence_scheduling: bool, max_num_batched_tokens: int,
                 max_model_len: int, synthetic_acceptance_length: float | None = None, measured_policy: bool = False):
        self.drafter = drafter
        self.max_drafts = max_drafts
        self.confidence_scheduling = confidence_scheduling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()
        self.synthetic_acceptance_length = synthetic_acceptance_length
        # benchmarks only: each verified draft accepted at this conditional rate, whatever the target samples
        self.synthetic_rate = (None if synthetic_acceptance_length is None
                               else synthetic_rate(synthetic_acceptance_length, max_drafts))
        # confidence scheduling's measured policy (engine/draft_policy.py): the step's draft length from timed steps
        self.policy = DraftPolicy(max_drafts) if confidence_scheduling and measured_policy else None
        # the lengths a step can verify at different costs; padded (CUDA-graph) steps cost the same for every k > 0,
        # so the step modes that pad narrow this to (0, max_drafts)
        self.policy_choices = tuple(range(max_drafts + 1))
        # the length chosen for the next step and what drafting for it cost: booked with that step's time
        self.pending_choice: int | None = None
        self.pending_draft_seconds = 0.0
        self.pending_captures = 0  # ``cuda_graphs.captures`` as drafting for the step began

    def floor(self, decoding: int) -> float | None:
        """The per-request survival floor of a step of ``decoding`` requests (None: no confidence scheduling). With
        the measured policy the step's load is priced by measured cost instead, so only the lowest floor remains:
        drafts nearly certain to fail are not verified. None under synthetic acceptance too: its draws ignore the
        drafts, so their confidences say nothing of them (a dummy-weight drafter's cut nearly every draft, and the
        policy then booked those cuts as acceptance of 0.16 at L = 2.8: H100, V4.1-Flash shapes, 2026-12-06)."""
        if not self.confidence_scheduling or self.synthetic_rate is not None:
            return None
        if self.policy is not None:
            return MIN_SURVIVAL
        return survival_floor(decoding, self.max_drafts, self.max_num_batched_tokens)

    def record_step(self, scheduled, accepted: list[int], seconds: float) -> None:
        """A synchronous step's time and its requests' accepted drafts, for the measured policy. Only decode-only
        steps drafted for by the policy are timed: a prefill chunk's cost says nothing about a draft length's, nor
        does a step that captured a CUDA graph (seconds, once) about its replays'."""
        if self.policy is None:
            return
        choice, self.pending_choice = self.pending_choice, None
        if choice:
            draft_policy.record_acceptance(self.policy, choice, accepted)
        decode_only = all(row.decodes for row in scheduled)
        if choice is not None and decode_only and scheduled and cuda_graphs.captures == self.pending_captures:
            draft_policy.record_cost(self.policy, len(scheduled), choice, seconds + self.pending_draft_seconds)

    def synthetic_counts(self, keys: torch.Tensor, positions: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
        """``synthetic_accepted`` at this engine's rate."""
        return synthetic_accepted(keys, positions, limits, self.synthetic_rate, self.max_drafts)

    def draft(self, running: list[Request], computed: list[ComputedRows], features: torch.Tensor | None,
              chosen: int | None = None) -> None:
        """``features``: the last step's ``ForwardOutput.features``, which ``computed`` indexes. ``chosen``: the
        draft length the measured policy already chose for the next step (where a plain run ends)."""
        candidates = [r for r in running if r.num_pending == 1 and not r.finished]  # no drafts pending
        rooms = {r: room for r in candidates if (room := draft_room(self.end(r), len(r.token_ids))) > 0}
        decoding = list(rooms)
        if not decoding and not computed:
            return
        started = time.perf_counter()
        self.pending_captures = cuda_graphs.captures
        limit = self.max_drafts
        if self.policy is not None and decoding:
            limit = chosen if chosen is not None else draft_policy.choose(self.policy, len(decoding),
                                                                          self.policy_choices)[0]
            self.pending_choice = limit
            if limit == 0:  # plain decoding next: the drafter only keeps what was computed, no draft pass
                self.drafter.propose([], computed, features)
                self.pending_draft_seconds = time.perf_counter() - started
                return
        # asked even when no request decodes next (a chunk of a long prefill): the drafter keeps what was computed
        drafts = self.drafter.propose(decoding, computed, features)
        if len(drafts) != len(decoding):
            raise RuntimeError(f"drafter {self.drafter.name} returned {len(drafts)} drafts for {len(decoding)} requests")
        self.pending_draft_seconds = time.perf_counter() - started
        if not drafts:
            return
        lengths = verified_on_host(drafts, [min(limit, rooms[r]) for r in decoding], self.floor(len(decoding)))
        for request, draft, length in zip(decoding, drafts, lengths):
            if request.grammar is not None:  # structured outputs: only drafts the grammar allows are verified
                length = allowed_drafts(request.grammar, draft.token_ids[:length])
            request.set_drafts(list(draft.token_ids[:length]))

    def end(self, request: Request) -> int:
        """The length ``request``'s tokens must stop at: ``max_tokens`` outputs, within ``max_model_len``."""
        return min(request.params.max_tokens + len(request.prompt_token_ids), self.max_model_len)

    @staticmethod
    def rows(requests: list[Request]) -> list[tuple[Request, int]]:
        """The sampled rows of a step, in logits order: each request's last real token, then each draft."""
        return [(r, j) for r in requests for j in range(r.num_drafts + 1)]


def log_summary(speculator: Speculator | None) -> None:
    if speculator is not None and speculator.stats.num_drafts:
        logger.info(speculator.stats.summary())
    if speculator is not None and speculator.policy is not None and speculator.policy.chosen:
        logger.info(draft_policy.summary(speculator.policy))

