"""What ``generate`` returns, shaped like vLLM's outputs so existing consumers keep working."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
_SHOWN_IDS = 8  # token lists are long; reprs show their head and a count


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token under the raw model distribution."""

    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is "stop" (EOS, a stop token or a stop string) or "length" (``max_tokens``
    or the context limit), ``None`` while generating. ``stop_reason`` is the stop string or stop
    token id that ended it, ``None`` for EOS, length, or while generating.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token: token id -> Logprob
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        logprobs = None if self.logprobs is None else f"<{len(self.logprobs)} steps>"
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={_abbreviate(self.token_ids)}, "
            f"logprobs={logprobs}, cumulative_logprob={self.cumulative_logprob}, "
            f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})"
        )


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic()`` seconds) and counts of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Sampling steps that produced tokens, i.e. the length of the longest completion.
    num_generated_tokens: int = 0
    # speculative decoding, counted as vLLM does: steps that verified drafts, the draft tokens verified, those
    # accepted, and accepted ones by draft position; mean acceptance length = 1 + accepted / drafts
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between tokens after the first; ``None`` until finished with >= 2 tokens."""
        if self.first_token_time is None or self.finished_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its completions so far (or final)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={_abbreviate(self.prompt_token_ids)}, outputs={self.outputs!r}, "
            f"finished={self.finished}, metrics={self.metrics!r})"
        )


def _abbreviate(token_ids: list[int]) -> str:
    if len(token_ids) <= _SHOWN_IDS:
        return repr(token_ids)
    head = ", ".join(str(t) for t in token_ids[:_SHOWN_IDS])
    return f"[{head}, ... ({len(token_ids)} ids)]"
