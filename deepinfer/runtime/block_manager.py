"""Block tables per request and kind, with reference counts and a hash-keyed prefix cache.

A full token block gets a hash chained on its parent's, so the hash names the whole prefix.
Freed blocks that carry a hash stay readable (least recently freed evicted first) until their
memory is needed, so a later request with the same prefix, or a preempted one coming back,
starts from them. For a kind that drops old rows only the blocks a resumed request still reads
must be cached: that is what makes sliding-window KV and compressor state cacheable at all.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from deepinfer.runtime.images import covered_digests
from deepinfer.runtime.kv_cache import CacheKind

FREED = -1


class _KindAllocator:
    def __init__(self, num_blocks: int):
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.evictable[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.block_hash[block] is None:
                self.free.append(block)
            else:
                self.evictable[block] = None

    def publish(self, block: int, block_hash: bytes) -> None:
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block


class BlockManager:
    def __init__(self, kinds: list[CacheKind], blocks_per_kind: dict[str, int], block_size: int, prefix_caching: bool):
        self.kinds = kinds
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocators = {k.name: _KindAllocator(blocks_per_kind[k.name]) for k in kinds}

    # -- allocation -------------------------------------------------------------------------
    def _missing(self, tables: dict[str, list[int]], kind: CacheKind, start: int, end: int) -> list[int]:
        """Token blocks of ``kind`` that positions [first_needed(start), end) need and lack."""
        table = tables.get(kind.name, [])
        first = kind.first_needed(start) // self.block_size
        last = -(-end // self.block_size)
        if last <= len(table) and FREED not in table[first:last]:  # a decode step inside its blocks: most steps
            return []
        return [j for j in range(first, last) if j >= len(table) or table[j] == FREED]

    def reserve(self, tables: dict[str, list[int]], start: int, end: int) -> bool:
        """Give ``tables`` the blocks positions [start, end) lack, if every kind has enough left; otherwise take
        nothing and return False."""
        missing = [(kind, m) for kind in self.kinds if (m := self._missing(tables, kind, start, end))]
        if any(len(m) > self.allocators[kind.name].num_available() for kind, m in missing):
            return False
        for kind, blocks in missing:
            table = tables.setdefault(kind.name, [])
            allocator = self.allocators[kind.name]
            for j in blocks:
                table.extend([FREED] * (j + 1 - len(table)))
                table[j] = allocator.take()
        return True

    def trim(self, tables: dict[str, list[int]], num_computed: int) -> None:
        """Release blocks whose rows no future step reads. A table's released blocks are a prefix of it (blocks are
        released from the oldest, and a cached prefix is attached from the first block its kind needs), so the
        walk goes back from the last block to release and stops at the first one already released."""
        for kind in self.kinds:
            if kind.keep_all:
                continue
            table, allocator = tables.get(kind.name, []), self.allocators[kind.name]
            j = min(kind.first_needed(num_computed) // self.block_size, len(table)) - 1
            while j >= 0 and table[j] != FREED:
                allocator.release(table[j])
                table[j] = FREED
                j -= 1

    def free(self, tables: dict[str, list[int]]) -> None:
        for kind_name, table in tables.items():
            allocator = self.allocators[kind_name]
            for block in reversed(table):
                if block != FREED:
                    allocator.release(block)
        tables.clear()

    # -- prefix cache -----------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int], num_blocks: int, known: list[bytes], images=()) -> list[bytes]:
        """Chained hashes of the first ``num_blocks`` full token blocks (extends ``known``). A block holding part
        of an image's span (``images``: ``ImageSpan``s) mixes in the image's digest: every image position has the
        same token id, so only the digest tells two images apart."""
        size = self.block_size
        for j in range(len(known), num_blocks):
            parent = known[-1] if known else b""
            tokens = np.asarray(token_ids[j * size : (j + 1) * size], dtype=np.int64).tobytes()
            pixels = covered_digests(images, j * size, (j + 1) * size) if images else b""
            known.append(hashlib.blake2b(parent + tokens + pixels, digest_size=16).digest())
        return known

    def publish(self, tables, hashes: list[bytes], num_computed: int, windows: bool = True) -> None:
        """Offer every full, computed token block for reuse (``windows=False``: not the sliding-window KV's)."""
        if not self.prefix_caching:
            return
        for kind in self.kinds:
            if not windows and kind.name == "swa":
                continue
            table, allocator = tables.get(kind.name, []), self.allocators[kind.name]
            for j in range(min(num_computed // self.block_size, len(table), len(hashes))):
                if table[j] != FREED:
                    allocator.publish(table[j], hashes[j])

    def match_prefix(self, tables, hashes: list[bytes], max_tokens: int) -> int:
        """Attach the longest cached prefix (whole blocks, at most ``max_tokens``); returns its length."""
        if not self.prefix_caching:
            return 0
        for num_blocks in range(min(len(hashes), max_tokens // self.block_size), 0, -1):
            boundary = num_blocks * self.block_size
            needed = {
                kind.name: range(kind.first_needed(boundary) // self.block_size, num_blocks) for kind in self.kinds
            }
            if all(hashes[j] in self.allocators[k].cached for k, js in needed.items() for j in js):
                for kind_name, js in needed.items():
                    allocator = self.allocators[kind_name]
                    table = tables.setdefault(kind_name, [FREED] * num_blocks)
                    for j in js:
                        table[j] = allocator.cached[hashes[j]]
                        allocator.share(table[j])
                return boundary
        return 0

    def usage(self) -> dict[str, float]:
        return {name: 1 - a.num_available() / len(a.refs) for name, a in self.allocators.items()}
