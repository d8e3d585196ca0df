"""Writing attention rows into the cache in one launch: FP8 rows (``deepinfer.runtime.fp8_kv``) are quantized and
scattered by one Triton program per row, where the reference takes a dozen torch ops. Bit-identical to the
reference: the exponent comes from the bits of ``amax / 448`` (correctly rounded division), the scale is built as
bits, and values are rounded to nearest even on their bits before any conversion, so the conversions themselves
are exact (Triton's interpreter mis-rounds float8 casts that carry into the exponent)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime import fp8_kv
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import _round_to_e4m3

# the layout as constants the kernels fold in (the attention kernel reads with the same ones)
PAGE, PAGE_BYTES = tl.constexpr(fp8_kv.PAGE), tl.constexpr(fp8_kv.PAGE_BYTES)
ROW_BYTES, SCALE_BYTES = tl.constexpr(fp8_kv.ROW_BYTES), tl.constexpr(fp8_kv.SCALE_BYTES)
NOPE, TILE, WIDTH = tl.constexpr(fp8_kv.D_NOPE), tl.constexpr(fp8_kv.TILE), tl.constexpr(fp8_kv.WIDTH)


@triton.jit
def _fp8_store_kernel(rows_ptr, stride_rows, slots_ptr, stride_slots, fp8_ptr, bytes_ptr):
    wait_for_inputs()
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i * stride_slots).to(tl.int64)
    base = (slot // PAGE) * PAGE_BYTES
    data = base + (slot % PAGE) * ROW_BYTES
    scales = base + PAGE * ROW_BYTES + (slot % PAGE) * SCALE_BYTES
    x = tl.reshape(tl.load(rows_ptr + i * stride_rows + tl.arange(0, WIDTH)).to(tl.float32), (WIDTH // TILE, TILE))
    tile = tl.arange(0, WIDTH // TILE)  # the last tile is the RoPE channels: not quantized
    # ceil(log2(max(amax / 448, 1e-4))) from the bits: the exponent, plus one unless the mantissa is zero
    bound = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-4).to(tl.int32, bitcast=True)
    exponent = ((bound >> 23) & 0xFF) - 127 + ((bound & 0x7FFFFF) != 0).to(tl.int32)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^-exponent, exactly
    quantized = _round_to_e4m3(x * inverse[:, None]).to(tl.float8e4nv)
    offs = tile[:, None] * TILE + tl.arange(0, TILE)[None, :]
    is_nope = offs < NOPE
    tl.store(fp8_ptr + data + offs, quantized, mask=is_nope)
    bits = x.to(tl.int32, bitcast=True)
    rope = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # bf16 bits, rounded to nearest even
    rope_at = data + NOPE + 2 * (offs - NOPE)
    tl.store(bytes_ptr + rope_at, (rope & 0xFF).to(tl.uint8), mask=~is_nope)
    tl.store(bytes_ptr + rope_at + 1, (rope >> 8).to(tl.uint8), mask=~is_nope)
    biased = tl.where(tile < WIDTH // TILE - 1, exponent + 127, 0)  # the eighth byte is padding
    tl.store(bytes_ptr + scales + tile, biased.to(tl.uint8))


def store_rows(pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``AttentionBackend.store_rows``: FP8 rows in one launch, row tensors with ``index_copy_``."""
    if not isinstance(pool, fp8_kv.FP8Rows):
        pool.index_copy_(0, slots, rows.to(pool.dtype))
        return
    if rows.shape[-1] != fp8_kv.WIDTH:
        raise ValueError(f"the FP8 KV layout holds {fp8_kv.WIDTH}-wide rows, got {list(rows.shape)}")
    if rows.shape[0]:
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        _fp8_store_kernel[(rows.shape[0],)](rows, rows.stride(0), slots, slots.stride(0),
                                            pool.data.view(torch.float8_e4m3fn), pool.data, **LAUNCH)
