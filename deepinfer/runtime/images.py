"""A request's images as the engine carries them: where each image's span lies in the prompt and what fills it.

An image is preprocessed once, when its request is checked (``engine/image_inputs.py``); its patches stay with the
request, so a preempted request re-encodes them if the encoder cache dropped their embeddings. Each image is named
by a digest of its patches and grid: equal images share embeddings (``engine/encoder_cache.py``) and prefix-cache
blocks (``BlockManager.block_hashes``); different ones never do, although their token ids are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the model's preprocessing is above this folder (models import runtime)
    from deepinfer.models.deepseek_v41.image_processing import ProcessedImage


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    """One image of a request: its span is prompt positions ``start`` to ``end - 1``."""

    start: int
    image: "ProcessedImage"
    digest: bytes

    @property
    def num_tokens(self) -> int:
        return self.image.grid.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


def covered_digests(images: Sequence[ImageSpan], begin: int, end: int) -> bytes:
    """The digests of the images whose spans overlap positions [begin, end), in prompt order."""
    return b"".join(span.digest for span in images if span.start < end and span.end > begin)


@dataclass(frozen=True, slots=True)
class StepImagePart:
    """The part of one image's span a step computes: step rows ``row`` to ``row + count - 1`` hold span
    positions ``offset`` to ``offset + count - 1``."""

    span: ImageSpan
    row: int
    offset: int
    count: int


def step_image_parts(scheduled) -> list[StepImagePart]:
    """What each image of a ``ScheduledBatch`` contributes to it: a prefill chunk may start or end inside a span."""
    parts, first = [], 0
    for row in scheduled:
        for span in row.request.images:
            begin, end = max(row.start, span.start), min(row.end, span.end)
            if begin < end:
                parts.append(StepImagePart(span, first + begin - row.start, begin - span.start, end - begin))
        first += row.count
    return parts
