"""DeepSeek's checkpoint weight formats: block-scaled FP8 and MXFP4, both with power-of-two scales.

* FP8: ``float8_e4m3fn`` values with one ``float8_e8m0fnu`` scale per ``block x block`` tile (128 in V4, 32
  in V4.1), or per ``1 x 32`` row segment for V4.1's Engram tables (``quantize_fp8(w, 1, 32)``).
* MXFP4 (routed experts): e2m1 codes packed two per ``int8`` byte, the even column in the low nibble, with
  one e8m0 scale per ``1 x 32`` row segment.

Writers exist so tests and the tiny-model tools can produce checkpoints in the released layout.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MX_BLOCK = 32
# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, fp32), exact: bumps the exponent when any mantissa bit is set."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _tile_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """Expand a per-tile scale to one value per element of a ``rows x cols`` matrix."""
    s = scale.float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return s[:rows, :cols]


def quantize_fp8(weight: torch.Tensor, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` -> (e4m3 ``[R, C]``, e8m0 scale ``[ceil(R/br), ceil(C/bc)]``)."""
    rows, cols = weight.shape
    pad = (0, -cols % block_cols, 0, -rows % block_rows)
    tiles = torch.nn.functional.pad(weight.float(), pad)
    tiles = tiles.unflatten(0, (-1, block_rows)).unflatten(2, (-1, block_cols))  # [r, br, c, bc]
    amax = tiles.abs().amax(dim=(1, 3))
    scale = _pow2_ceil(amax.clamp(min=1e-30) / E4M3_MAX)
    values = (weight.float() / _tile_scale(scale, rows, cols, block_rows, block_cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return values.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = weight.shape
    block_rows, block_cols = infer_block(rows, scale.shape[0]), infer_block(cols, scale.shape[1])
    return (weight.float() * _tile_scale(scale, rows, cols, block_rows, block_cols)).to(dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` -> (packed int8 ``[R, C/2]``, e8m0 scale ``[R, C/32]``), round to nearest, ties to even code."""
    rows, cols = weight.shape
    if cols % MX_BLOCK:
        raise ValueError(f"MXFP4 needs a column count divisible by {MX_BLOCK}, got {cols}")
    groups = weight.float().view(rows, cols // MX_BLOCK, MX_BLOCK)
    scale = _pow2_ceil(groups.abs().amax(-1).clamp(min=1e-30) / E2M1_MAX)
    scaled = (groups / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).view(rows, cols)
    levels = torch.tensor(E2M1_VALUES[:8])
    magnitude = scaled.abs()
    # nearest level; on an exact midpoint pick the even code, as IEEE rounding does
    distance = (magnitude.unsqueeze(-1) - levels).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = (distance == best).to(torch.int64) * (torch.arange(8) % 2 == 0).to(torch.int64)
    code = torch.where(candidates.any(-1), candidates.argmax(-1), distance.argmin(-1))
    code = code + 8 * (scaled < 0).to(torch.int64) * (code > 0).to(torch.int64)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, half = packed.shape
    raw = packed.view(torch.uint8).to(torch.int64)
    lut = torch.tensor(E2M1_VALUES, device=packed.device)
    values = torch.stack((lut[raw & 0xF], lut[raw >> 4]), dim=-1).view(rows, 2 * half)
    return (values * scale.float().repeat_interleave(MX_BLOCK, 1)[:, : 2 * half]).to(dtype)


def infer_block(size: int, num_blocks: int) -> int:
    """The power-of-two tile edge that splits ``size`` into ``num_blocks`` tiles (1 for per-row scales).

    Different edges only agree on the tile count when there is a single tile, in which case every candidate maps
    all rows to it, so the choice cannot change the result.
    """
    block = 1
    while -(-size // block) > num_blocks:
        block *= 2
    if -(-size // block) != num_blocks:
        raise ValueError(f"a scale with {num_blocks} blocks cannot tile {size} elements with power-of-two blocks")
    return block


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Either format, told apart by the weight dtype (FP4 is packed in int8)."""
    if weight.dtype == torch.int8:
        if scale.shape != (weight.shape[0], 2 * weight.shape[1] // MX_BLOCK):
            raise ValueError(f"MXFP4 weight {tuple(weight.shape)} needs a scale of shape "
                             f"{(weight.shape[0], 2 * weight.shape[1] // MX_BLOCK)}, got {tuple(scale.shape)}")
        return dequantize_fp4(weight, scale, dtype)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale, dtype)
    raise ValueError(f"a weight with a scale must be float8_e4m3fn or packed-FP4 int8, got {weight.dtype}")
