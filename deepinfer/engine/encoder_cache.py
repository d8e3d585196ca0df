"""The vision encoder's outputs, kept by image digest so that each image is encoded once.

A step's image rows (``runtime/images.py``: a prefill chunk may hold any part of a span) take their embeddings
from here; the embeddings of an image are computed on its first use and kept, least recently used dropped first,
within ``capacity_tokens`` span positions. A request whose image was dropped (a long queue, a preemption) gets it
encoded again from the patches it carries.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from deepinfer.models.deepseek_v41.vision import VisionEncoder
from deepinfer.runner.forward_batch import ImageRows
from deepinfer.runtime.images import ImageSpan, step_image_parts


class EncoderCache:
    def __init__(self, encoder: VisionEncoder, device: torch.device, capacity_tokens: int):
        self.encoder = encoder
        self.device = device
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.hits = self.misses = 0

    @torch.inference_mode()
    def span_embeddings(self, span: ImageSpan) -> torch.Tensor:
        """[span.num_tokens, hidden]: the embeddings of every position of the image's span."""
        cached = self.entries.get(span.digest)
        if cached is not None:
            self.hits += 1
            self.entries.move_to_end(span.digest)
            return cached
        self.misses += 1
        grid = span.image.grid
        tokens = self.encoder(span.image.patches.to(self.device), grid.rows, grid.cols)
        embeddings = self.encoder.span_embeddings(tokens, grid.token_rows, grid.token_cols)
        self.entries[span.digest] = embeddings
        self.num_tokens += span.num_tokens
        while self.num_tokens > self.capacity_tokens and len(self.entries) > 1:  # the newest always stays
            _, dropped = self.entries.popitem(last=False)
            self.num_tokens -= dropped.shape[0]
        return embeddings

    def step_images(self, scheduled) -> ImageRows | None:
        """The step's image rows and their embeddings; None for a step without any."""
        parts = step_image_parts(scheduled)
        if not parts:
            return None
        rows = torch.cat([torch.arange(p.row, p.row + p.count) for p in parts])
        embeddings = torch.cat([self.span_embeddings(p.span)[p.offset:p.offset + p.count] for p in parts])
        return ImageRows(rows.to(self.device), embeddings)
