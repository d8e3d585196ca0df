"""DeepSeek's checkpoint weight formats: block-scaled FP8 and MXFP4, both with power-of-two scales.

* FP8: ``float8_e4m3fn`` values with one ``float8_e8m0fnu`` scale per ``block x block`` tile (128 in V4, 32
  in V4.1), or per ``1 x 32`` row segment for V4.1's Engram tables (``quantize_fp8(w, 1, 32)``).
* MXFP4 (routed experts): e2m1 codes packed two per ``int8`` byte, the even column in the low nibble, with
  one e8m0 scale per ``1 x 32`` row segment.

Weights stay in these formats in memory; ``blockwise_linear`` is the reference GEMM over them. Like the release's
kernels it first rounds the activations to FP8 (one power-of-two scale per ``1 x block`` segment), so it matches
what a fused FP8 kernel computes up to fp32 summation order. Writers exist so tests and tools can produce
checkpoints in the released layout.
"""

from __future__ import annotations

import functools

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MX_BLOCK = 32
# e2m1 code -> value; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.cache
def constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small lookup table, copied to ``device`` once (a copy inside a CUDA-graph capture would be an error)."""
    return torch.tensor(values, dtype=dtype, device=device)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, fp32), exact: bumps the exponent when any mantissa bit is set."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def round_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize-dequantize the last dim to e4m3 with one power-of-two scale per ``block`` values (``act_quant``)."""
    channels = x.shape[-1]
    groups = torch.nn.functional.pad(x.float(), (0, -channels % block)).unflatten(-1, (-1, block))
    scale = _pow2_ceil(groups.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1 / E4M3_MAX))
    codes = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (codes * scale).flatten(-2)[..., :channels].to(x.dtype)


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
    if rows % block_rows or cols % block_cols:  # partial edge tiles: the scale expanded to every element
        return (weight.float() * _tile_scale(scale, rows, cols, block_rows, block_cols)).to(dtype)
    tiles = weight.float().view(rows // block_rows, block_rows, cols // block_cols, block_cols)
    return (tiles * scale.float()[:, None, :, None]).view(rows, cols).to(dtype)


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """e2m1 code (bit 3 = sign) of the nearest value to each of ``scaled`` (already in [-6, 6]); an exact midpoint
    goes to the even code, as IEEE rounding does."""
    magnitude = scaled.abs().contiguous()
    midpoints = constant(_E2M1_MIDPOINTS, magnitude.dtype, magnitude.device)
    code = torch.bucketize(magnitude, midpoints)
    on_midpoint = magnitude == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (on_midpoint & (code % 2 == 1)).to(code.dtype)
    return code + 8 * ((scaled < 0) & (code > 0)).to(code.dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` -> (packed int8 ``[R, C/2]``, e8m0 scale ``[R, C/32]``), round to nearest, ties to even code."""
    rows, cols = weight.shape
    if cols % MX_BLOCK:
        raise ValueError(f"MXFP4 needs a column count divisible by {MX_BLOCK}, got {cols}")
    groups = weight.float().view(rows, cols // MX_BLOCK, MX_BLOCK)
    scale = _pow2_ceil(groups.abs().amax(-1).clamp(min=1e-30) / E2M1_MAX)
    code = e2m1_codes((groups / scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).view(rows, cols))
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


@functools.cache
def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: the two values each packed byte holds, the low nibble's first (one lookup per byte)."""
    values, byte = torch.tensor(E2M1_VALUES), torch.arange(256)
    return torch.stack((values[byte & 0xF], values[byte >> 4]), dim=1).to(device)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, half = packed.shape
    values = torch.nn.functional.embedding(packed.view(torch.uint8).int(), _e2m1_pairs(packed.device))
    if (2 * half) % MX_BLOCK:  # a partial last block: its scale expanded to every value
        return (values.view(rows, 2 * half) * scale.float().repeat_interleave(MX_BLOCK, 1)[:, : 2 * half]).to(dtype)
    blocks = values.view(rows, 2 * half // MX_BLOCK, MX_BLOCK) * scale.float()[:, : 2 * half // MX_BLOCK, None]
    return blocks.view(rows, 2 * half).to(dtype)


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


def scale_shape(stored: tuple[int, ...], dtype: torch.dtype, block: tuple[int, int]) -> tuple[int, ...]:
    """The scale a stored ``[..., R, C]`` weight needs: one per ``block`` tile (FP8), one per 1 x 32 (MXFP4)."""
    *lead, rows, cols = stored
    if dtype == torch.int8:  # packed: C holds two values per byte
        return (*lead, rows, 2 * cols // MX_BLOCK)
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def logical_shape(stored: tuple[int, ...], dtype: torch.dtype) -> tuple[int, ...]:
    """The float shape a stored weight stands for (packed MXFP4 holds two columns per byte)."""
    return (*stored[:-1], 2 * stored[-1]) if dtype == torch.int8 else tuple(stored)


# Weight elements dequantized per step of the reference GEMM, bounding its temporary memory.
_DEQUANT_CHUNK = 1 << 22


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, activation_block: int) -> torch.Tensor:
    """``x W^T`` for an FP8 or MXFP4 ``weight`` [R, C], as the release's block-scaled GEMMs compute it.

    ``x`` [..., C] is rounded to FP8 in ``1 x activation_block`` segments, the weight is dequantized a slab of
    rows at a time (never as a whole), and products accumulate in fp32. Returns [..., R] in ``x``'s dtype.
    """
    xq = round_fp8(x, activation_block).float()
    rows, cols = weight.shape[0], logical_shape(tuple(weight.shape), weight.dtype)[1]
    row_block = 1 if weight.dtype == torch.int8 else infer_block(rows, scale.shape[0])
    step = max(row_block, _DEQUANT_CHUNK // cols // row_block * row_block)
    out = torch.empty(*x.shape[:-1], rows, dtype=torch.float32, device=x.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        w = dequantize(weight[start:stop], scale[start // row_block: -(-stop // row_block)], torch.float32)
        out[..., start:stop] = xq @ w.T
    return out.to(x.dtype)


def weight_block_size(quantization_config: dict | None, default: tuple[int, int]) -> tuple[int, int]:
    """The FP8 weight tile from ``quantization_config.weight_block_size``, validated; ``default`` when absent."""
    block = (quantization_config or {}).get("weight_block_size")
    if block is None:
        return default
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two powers of two, got {block!r}")
    return tuple(block)
