"""Paged storage for every kind of per-request model state.

A *kind* groups pools that share row geometry and retention: raw sliding-window KV (one row per
token, only the last ``window`` kept), compressed entries (one row per ``ratio`` tokens, all kept)
and compressor state (one row per token, only the rows still to be pooled kept). Every kind is
paged in blocks of ``block_size`` tokens; token block ``j`` of a request covers positions
``[j*block_size, (j+1)*block_size)`` in every kind, which is what lets the prefix cache key all
kinds by the same token hashes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runtime import fp8_kv


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    layers: tuple[int, ...]
    width: int
    dtype: torch.dtype
    fp8: bool = False  # rows stored in DeepSeek-V4's FP8 layout (``fp8_kv``); reading them gives ``dtype``


@dataclass(frozen=True, slots=True)
class CacheKind:
    """Rows of ``tokens_per_row`` tokens; rows before ``first_needed(n)`` may be dropped.

    ``first_needed(n) = align_down(n, align) - back`` once ``n`` tokens are computed; a kind
    with ``keep_all`` never drops rows.
    """

    name: str
    tokens_per_row: int
    pools: tuple[Pool, ...]
    keep_all: bool = True
    align: int = 1
    back: int = 0

    def first_needed(self, num_computed: int) -> int:
        if self.keep_all:
            return 0
        return max(0, num_computed // self.align * self.align - self.back)


def sliding_kind(name: str, window: int, pools: tuple[Pool, ...]) -> CacheKind:
    """Raw rows of the last ``window`` tokens (the current token included)."""
    return CacheKind(name, 1, pools, keep_all=False, align=1, back=window - 1)


def compressor_state_kind(name: str, ratio: int, overlap: int, pools: tuple[Pool, ...]) -> CacheKind:
    """Per-token compressor rows until the ``overlap`` windows that pool them have closed."""
    return CacheKind(name, 1, pools, keep_all=False, align=ratio, back=(overlap - 1) * ratio)


class KVCache:
    """The tensors: for each (kind, pool), ``[layers in pool, blocks * rows_per_block + 1, width]``, or for an FP8
    pool ``[layers, pages, fp8_kv.PAGE_BYTES]`` bytes holding as many rows (``pool`` gives ``fp8_kv.FP8Rows``).

    The last row of every pool belongs to no block: padded tokens of a CUDA-graph batch write there.
    """

    def __init__(self, kinds: list[CacheKind], blocks_per_kind: dict[str, int], block_size: int, device):
        self.block_size = block_size
        self.kinds = {k.name: k for k in kinds}
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}
        self._layer_index: dict[tuple[str, str], dict[int, int]] = {}
        self._fp8: dict[tuple[str, str], bool] = {}
        self.scratch_rows: dict[str, int] = {}
        for kind in kinds:
            if block_size % kind.tokens_per_row:
                raise ValueError(f"block_size {block_size} must be a multiple of {kind.name}'s {kind.tokens_per_row} tokens per row")
            rows = blocks_per_kind[kind.name] * self.rows_per_block(kind.name) + 1
            self.scratch_rows[kind.name] = rows - 1
            for pool in kind.pools:
                key = (kind.name, pool.name)
                if pool.fp8:
                    if pool.width != fp8_kv.WIDTH:
                        raise ValueError(f"{kind.name}/{pool.name}: the FP8 KV layout holds {fp8_kv.WIDTH}-wide rows, "
                                         f"this pool's are {pool.width}")
                    shape, dtype = fp8_kv.storage_shape(rows), torch.uint8
                else:
                    shape, dtype = (rows, pool.width), pool.dtype
                self._tensors[key] = torch.zeros(len(pool.layers), *shape, dtype=dtype, device=device)
                self._fp8[key] = pool.fp8
                self._layer_index[key] = {layer: i for i, layer in enumerate(pool.layers)}

    def rows_per_block(self, kind: str) -> int:
        return self.block_size // self.kinds[kind].tokens_per_row

    def pool(self, kind: str, name: str, layer: int) -> torch.Tensor | fp8_kv.FP8Rows:
        key = (kind, name)
        rows = self._tensors[key][self._layer_index[key][layer]]
        return fp8_kv.FP8Rows(rows) if self._fp8[key] else rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())


def bytes_per_block(kind: CacheKind, block_size: int) -> int:
    rows = block_size // kind.tokens_per_row

    def row_bytes(p: Pool) -> int:
        return fp8_kv.TOKEN_BYTES if p.fp8 else p.width * torch.empty((), dtype=p.dtype).element_size()

    return sum(rows * row_bytes(p) * len(p.layers) for p in kind.pools)
