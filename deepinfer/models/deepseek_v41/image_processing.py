"""DeepSeek-V4.1's image preprocessing: the resize plan, normalized patches and the image's tokens in the prompt.

An image is resized to whole ViT patches: scaled up to about ``min_pixels`` when smaller, squeezed to
``max_wh_ratio`` when wider, and scaled down until its span fits ``max_image_tokens``. Its RGB values map to
[-1, 1] and are cut into row-major ``patch x patch`` patches (bf16, as the release feeds its tower). In the prompt
the chat template's ``<｜deepseek_image｜>`` placeholder becomes the image span: a start token, one line per row
of merged cells (``token_cols`` image tokens and a row end), an end token, every one of them ``image_token_id``;
what each position holds is told by its token type (``TEXT``, ``IMAGE_START``, ``IMAGE``, ...).

Images come as a ``PIL.Image``, a path, encoded bytes or a ``data:`` URL (``load_image``). Pillow is the
``vision`` extra: ``pip install 'deepinfer[vision]'``.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepinfer.models.deepseek_v41.config import VisionConfig

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
# 8-bit modes with a defined RGB conversion; 16/32-bit ones ("I;16", "I", "F") would be clipped, not scaled
SUPPORTED_MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr")
# where ``ImageOps.pad`` letterboxes the resized image (mid-grey, as the release pads)
PAD_COLOR = (127, 127, 127)


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImportError("DeepSeek-V4.1 image inputs need Pillow: pip install 'deepinfer[vision]'") from None
    return Image, ImageOps


@dataclass(frozen=True, slots=True)
class ImageGrid:
    """How one image is resized and how many tokens it takes."""

    height: int  # resized, in pixels
    width: int
    rows: int  # ViT patches
    cols: int
    token_rows: int  # image tokens: ceil(rows / downsample_ratio)
    token_cols: int

    @property
    def num_tokens(self) -> int:
        """The whole span: start, each token row and its row end, end."""
        return self.token_rows * (self.token_cols + 1) + 2


def _token_grid(height: int, width: int, c: VisionConfig) -> tuple[int, int]:
    return (math.ceil(height // c.patch_size / c.downsample_ratio),
            math.ceil(width // c.patch_size / c.downsample_ratio))


def plan_image_grid(width: int, height: int, c: VisionConfig) -> ImageGrid:
    """The resize of a ``width x height`` image, as the release plans it (its rounding included)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image needs a positive size; got {width}x{height}")
    wide: float = width
    high: float = height
    if c.max_wh_ratio is not None and width > height * c.max_wh_ratio:
        wide = height * c.max_wh_ratio
    if wide * high < c.min_pixels:
        grow = (c.min_pixels / (wide * high)) ** 0.5
        wide, high = int(wide * grow), int(high * grow)
    patch, budget = c.patch_size, c.max_image_tokens
    best_h, best_w = math.ceil(high / patch) * patch, math.ceil(wide / patch) * patch
    token_rows, token_cols = _token_grid(best_h, best_w, c)
    if token_rows * (token_cols + 1) + 2 > budget:
        # the largest token grid of the image's aspect whose span fits: rows * (cols + 1) + 2 <= budget
        aspect = high / wide
        max_cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
        max_rows = max_cols * aspect
        cell = patch * c.downsample_ratio
        if max_cols < 1:  # very tall: one column
            best_h, best_w = (budget - 2) // 2 * cell, cell
        elif max_rows < 1:  # very wide: one row
            best_h, best_w = cell, (budget - 3) * cell
        else:
            scale = min(math.floor(max_cols) * cell / wide, math.floor(max_rows) * cell / high)
            best_h = math.floor(high * scale / patch) * patch
            best_w = math.floor(wide * scale / patch) * patch
        token_rows, token_cols = _token_grid(best_h, best_w, c)
    if min(best_h, best_w) <= 0 or token_rows * (token_cols + 1) + 2 > budget:
        raise ValueError(f"a {width}x{height} image cannot fit in max_image_tokens={budget}")
    return ImageGrid(best_h, best_w, best_h // patch, best_w // patch, token_rows, token_cols)


def _decode(data: bytes, what: str):
    Image, _ = _pil()
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decodes now: a truncated file fails here, not inside the resize
    except Image.DecompressionBombError as error:
        raise ValueError(f"{what}: {error}") from None
    except (OSError, SyntaxError) as error:  # UnidentifiedImageError is an OSError; some decoders raise SyntaxError
        raise ValueError(f"{what} is not a readable image (unknown format, truncated or corrupt): {error}") from None
    return image


def _data_url(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError(f"a data: URL image must be base64 (data:image/png;base64,...); got {url[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the data: URL image is not valid base64: {error}") from None


def load_image(source: Any):
    """An RGB ``PIL.Image`` from a ``PIL.Image``, a path, encoded bytes or a ``data:image/...;base64,`` URL.
    ValueError names what is wrong with an unreadable, truncated or unsupported image."""
    Image, _ = _pil()
    if isinstance(source, Image.Image):
        image, what = source, f"the {source.mode} image"
    elif isinstance(source, (bytes, bytearray, memoryview)):
        image, what = _decode(bytes(source), "the image bytes"), "the image bytes"
    elif isinstance(source, str) and source.startswith("data:"):
        image, what = _decode(_data_url(source), "the data: URL image"), "the data: URL image"
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise ValueError(f"image URLs are not fetched (offline engine): download {source!r} and pass its bytes")
    elif isinstance(source, (str, os.PathLike)):
        what = f"image file {os.fspath(source)!r}"
        try:
            with open(source, "rb") as file:
                data = file.read()
        except OSError as error:
            raise ValueError(f"cannot read {what}: {error.strerror or error}") from None
        image = _decode(data, what)
    else:
        raise TypeError(f"an image must be a PIL.Image, a path, bytes or a data: URL; got {type(source).__name__}")
    if image.mode not in SUPPORTED_MODES:
        raise ValueError(f"{what} has mode {image.mode!r}, which has no RGB meaning here; supported modes: "
                         f"{', '.join(SUPPORTED_MODES)} (convert it to 8-bit RGB first)")
    if image.width <= 0 or image.height <= 0:
        raise ValueError(f"{what} is empty ({image.width}x{image.height})")
    return image.convert("RGB")


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    patches: torch.Tensor  # [rows * cols, 3, patch, patch] bf16 in [-1, 1], row-major
    grid: ImageGrid


def preprocess_image(source: Any, c: VisionConfig) -> ProcessedImage:
    """One image (anything ``load_image`` takes) -> the tower's patches and its grid."""
    Image, ImageOps = _pil()
    image = load_image(source)
    grid = plan_image_grid(image.width, image.height, c)
    size = (grid.width, grid.height)
    if c.max_wh_ratio is not None and image.width >= c.max_wh_ratio * image.height:
        image = image.resize(size, Image.Resampling.BICUBIC)  # squeezed: stretched to the grid
    else:
        image = ImageOps.pad(image, size, Image.Resampling.BICUBIC, color=PAD_COLOR)  # aspect kept, letterboxed
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16)
    p = c.patch_size
    patches = pixels.reshape(3, grid.rows, p, grid.cols, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return ProcessedImage(patches, grid)


def image_token_types(grid: ImageGrid) -> list[int]:
    """The token type of each position of the image's span, in prompt order."""
    return [IMAGE_START, *([IMAGE] * grid.token_cols + [IMAGE_NEW_LINE]) * grid.token_rows, IMAGE_END]


def expand_image_placeholders(token_ids: Sequence[int], image_token_id: int, grids: Sequence[ImageGrid]
                              ) -> tuple[list[int], list[int]]:
    """A tokenized prompt whose placeholders (one ``image_token_id`` per image, in order) become whole image
    spans -> (token ids, token types), types ``TEXT`` outside the spans."""
    placeholders = sum(1 for token in token_ids if token == image_token_id)
    if placeholders != len(grids):
        raise ValueError(f"the prompt has {placeholders} image placeholders but {len(grids)} images were given")
    ids: list[int] = []
    types: list[int] = []
    images = iter(grids)
    for token in token_ids:
        if token != image_token_id:
            ids.append(int(token))
            types.append(TEXT)
            continue
        span = image_token_types(next(images))
        ids += [image_token_id] * len(span)
        types += span
    return ids, types
