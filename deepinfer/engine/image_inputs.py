"""A request's images checked and preprocessed when it is submitted: its prompt's placeholders expanded to the
images' spans (``runtime/images.py``), each image named by a digest of its patches and grid."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from deepinfer.models.deepseek_v41.image_processing import (
    IMAGE_START, ProcessedImage, expand_image_placeholders, preprocess_image)
from deepinfer.runtime.images import ImageSpan


def image_digest(image: ProcessedImage) -> bytes:
    grid = image.grid
    shape = torch.tensor([grid.rows, grid.cols, grid.token_rows, grid.token_cols]).numpy().tobytes()
    return hashlib.blake2b(shape + image.patches.view(torch.int16).numpy().tobytes(), digest_size=16).digest()


def prepare_images(token_ids: Sequence[int], sources: Sequence, vision_config, image_token_id: int, name: str
                   ) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """A prompt's token ids with one ``image_token_id`` placeholder per image -> (the ids with every placeholder
    expanded to its image's span, the spans in prompt order). ValueError names ``name`` and the image's index."""
    processed = []
    for index, source in enumerate(sources):
        try:
            processed.append(preprocess_image(source, vision_config))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{name} image {index}: {error}") from None
    try:
        ids, types = expand_image_placeholders(token_ids, image_token_id, [p.grid for p in processed])
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None
    starts = [position for position, kind in enumerate(types) if kind == IMAGE_START]
    return ids, tuple(ImageSpan(start, p, image_digest(p)) for start, p in zip(starts, processed))
