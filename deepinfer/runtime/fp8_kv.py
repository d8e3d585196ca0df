"""DeepSeek-V4's FP8 KV cache layout (``kv_cache_dtype="fp8"``), the one FlashMLA's sparse decode reads.

A 512-wide attention row is 448 NoPE channels in e4m3 with one power-of-two (UE8M0) scale per 64 channels, plus
the 64 RoPE channels kept in bf16: 584 bytes instead of 1024. Rows live in pages of ``PAGE`` rows; within a page the
576-byte [NoPE | RoPE] rows come first, then the 8-byte [7 scale exponents | pad] rows, and a page is padded to a
multiple of 576 bytes (FlashMLA's ``tests/quant.py``). Pages are consecutive, so row ``r`` is FlashMLA's index
``page * PAGE + offset`` as it is: a pool needs no page table of its own.

Quantizing: the scale of a 64-channel tile is the smallest power of two that brings its largest magnitude within
e4m3's range (448), with a 1e-4 floor for all-zero tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime.quantization import E4M3_MAX, _pow2_ceil

D_NOPE, D_ROPE, TILE = 448, 64, 64
WIDTH = D_NOPE + D_ROPE  # 512 channels
ROW_BYTES = D_NOPE + 2 * D_ROPE  # 576
SCALE_BYTES = D_NOPE // TILE + 1  # 7 exponents and a pad byte
TOKEN_BYTES = ROW_BYTES + SCALE_BYTES  # 584
PAGE = 64
PAGE_BYTES = -(-PAGE * TOKEN_BYTES // ROW_BYTES) * ROW_BYTES


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` [n, 512] -> ([n, 576] row bytes, [n, 8] scale bytes), both uint8."""
    if rows.shape[-1] != WIDTH:
        raise ValueError(f"the FP8 KV layout holds {WIDTH}-wide rows, got {list(rows.shape)}")
    nope = rows[:, :D_NOPE].float().unflatten(-1, (-1, TILE))
    scale = _pow2_ceil((nope.abs().amax(-1) / E4M3_MAX).clamp_min(1e-4))  # [n, 7], powers of two
    values = (nope / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(1).view(torch.uint8)
    rope = rows[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    biased = scale.view(torch.int32) >> 23  # UE8M0 is the biased exponent itself
    scales = torch.cat((biased, biased.new_zeros(len(rows), 1)), 1)
    return torch.cat((values, rope), 1), scales.to(torch.uint8)


def dequantize(row_bytes: torch.Tensor, scale_bytes: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The inverse of ``quantize`` (up to e4m3 rounding): [..., 576] and [..., 8] uint8 -> [..., 512]."""
    nope = row_bytes[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, TILE))
    scale = torch.exp2(scale_bytes[..., : SCALE_BYTES - 1].float() - 127).unsqueeze(-1)
    rope = row_bytes[..., D_NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat(((nope * scale).flatten(-2).to(dtype), rope.to(dtype)), -1)


def storage_shape(rows: int) -> tuple[int, int]:
    """The uint8 shape holding ``rows`` rows: whole pages."""
    return -(-rows // PAGE), PAGE_BYTES


@dataclass(slots=True)
class FP8Rows:
    """One layer's pool of FP8 rows: ``data`` [pages, PAGE_BYTES] uint8. Indexing it with row ids gives the
    dequantized bf16 rows, so code that gathers rows (the reference attention) reads it like a tensor."""

    data: torch.Tensor

    @classmethod
    def zeros(cls, rows: int, device=None) -> "FP8Rows":
        return cls(torch.zeros(storage_shape(rows), dtype=torch.uint8, device=device))

    @property
    def num_rows(self) -> int:
        return self.data.shape[0] * PAGE

    def _offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        page, offset = slots // PAGE, slots % PAGE
        return page * PAGE_BYTES + offset * ROW_BYTES, page * PAGE_BYTES + PAGE * ROW_BYTES + offset * SCALE_BYTES

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Stores ``rows`` [n, 512] at row ids ``slots`` [n] (every id valid: a scratch row, not -1)."""
        row_bytes, scale_bytes = quantize(rows)
        row_at, scale_at = self._offsets(slots)
        flat = self.data.view(-1)
        flat.index_copy_(0, (row_at.unsqueeze(1) + torch.arange(ROW_BYTES, device=slots.device)).flatten(),
                         row_bytes.flatten())
        flat.index_copy_(0, (scale_at.unsqueeze(1) + torch.arange(SCALE_BYTES, device=slots.device)).flatten(),
                         scale_bytes.flatten())

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        row_at, scale_at = self._offsets(slots)
        flat = self.data.view(-1)
        row_bytes = flat[row_at.unsqueeze(-1) + torch.arange(ROW_BYTES, device=slots.device)]
        scale_bytes = flat[scale_at.unsqueeze(-1) + torch.arange(SCALE_BYTES, device=slots.device)]
        return dequantize(row_bytes, scale_bytes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16  # what reading it gives

    def flashmla_view(self) -> torch.Tensor:
        """``[pages, PAGE, 1, 584]`` e4m3 view with token stride 584, as FlashMLA's sparse decode takes it."""
        pages = self.data.shape[0]
        return self.data.view(torch.float8_e4m3fn).as_strided((pages, PAGE, 1, TOKEN_BYTES),
                                                              (PAGE_BYTES, TOKEN_BYTES, TOKEN_BYTES, 1))


def store(pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes ``rows`` into a cache pool: a plain tensor (in its dtype) or FP8 rows (quantized)."""
    if isinstance(pool, FP8Rows):
        pool.write(slots, rows)
    else:
        pool.index_copy_(0, slots, rows.to(pool.dtype))
