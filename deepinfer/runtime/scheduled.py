"""The scheduler's answer for one step (``ScheduledBatch``), read by everything that builds or runs the step.

Whether a request samples in a step, and which of its rows are drafts to verify, is decided once, when the
scheduler picks its rows: every reader (input building, CUDA graphs, sampling, verification) takes it from here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from deepinfer.runtime.request import Request


@dataclass(slots=True, eq=False)
class ScheduledRequest:
    """One request's rows in a step: positions ``start`` to ``start + count - 1``. ``samples``: the rows end at
    its last token, so the step samples its next token (and one token after each draft); ``drafts``: the last
    ``drafts`` rows are drafts to verify (0 when it does not sample)."""

    request: Request
    start: int
    count: int
    samples: bool
    drafts: int = 0

    @classmethod
    def of(cls, request: Request, start: int, count: int) -> "ScheduledRequest":
        """The rows of ``request`` from ``start`` as its ``token_ids`` stand now (drafts at their end)."""
        samples = start + count == len(request.token_ids)
        return cls(request, start, count, samples, min(request.num_drafts, count - 1) if samples else 0)

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def decodes(self) -> bool:
        """A decode row: the request's last token and its drafts, all sampled (a prefill chunk samples its last
        row only, however few rows it has)."""
        return self.samples and self.count == self.drafts + 1


@dataclass(slots=True)
class ScheduledBatch:
    """A step's requests in row order: request ``i``'s rows follow request ``i - 1``'s in the step's tokens."""

    rows: list[ScheduledRequest] = field(default_factory=list)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def requests(self) -> list[Request]:
        return [row.request for row in self.rows]

    @property
    def sampling(self) -> list[Request]:
        """The requests this step samples for, in row order."""
        return [row.request for row in self.rows if row.samples]

    @property
    def num_tokens(self) -> int:
        return sum(row.count for row in self.rows)
