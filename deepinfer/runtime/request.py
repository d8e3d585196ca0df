"""One sequence being generated: its tokens, progress, cache blocks and output bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer.outputs import Logprob, RequestMetrics
from deepinfer.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """``token_ids`` is prompt + generated tokens, then ``num_drafts`` proposed ones (speculative decoding: the
    next step verifies them); the first ``num_computed`` are in the caches."""

    request_id: str
    sample_index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_drafts: int = 0
    # SWA bounded replay: the first position the window-only decoder layers compute (0: every position)
    replay_start: int = 0
    grammar: object = None  # structured outputs: the request's GrammarMatcher (plugins/interfaces.py)
    # its images (``runtime/images.py``), kept to the end: a preempted request's recomputation encodes them again
    images: tuple = ()
    status: Status = Status.WAITING
    tables: dict[str, list[int]] = field(default_factory=dict)
    block_hashes: list[bytes] = field(default_factory=list)
    detokenizer: object = None  # IncrementalDetokenizer; its .text is the output text
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # as vLLM: kept only when ``logprobs`` is asked for
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    metrics: RequestMetrics = None

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) : len(self.token_ids) - self.num_drafts]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_drafts - len(self.prompt_token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]

    def set_drafts(self, token_ids: list[int]) -> None:
        self.drop_drafts()
        self.token_ids += token_ids
        self.num_drafts = len(token_ids)

    def drop_drafts(self, keep: int = 0) -> None:
        """Forget all but the first ``keep`` drafts (verified, rejected, or no longer fitting the step)."""
        if self.num_drafts > keep:
            del self.token_ids[len(self.token_ids) - self.num_drafts + keep :]
            self.num_drafts = keep

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
