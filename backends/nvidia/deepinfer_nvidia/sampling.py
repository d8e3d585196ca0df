"""Greedy tokens in two Triton launches: the sampler's ``argmax`` over fp32 logits rows.

torch's argmax reduces a single 129280-wide row (V4.1's vocabulary) in one block: 37 µs of a 2.8 ms batch-1 step
on an H200; one Triton program a row reading it in 8192-wide tiles took 22.6 µs on an H100. Here each row is cut
into ``CHUNK``-wide pieces, one program each (32 for V4.1 at batch 1, one round of loads), whose maxima a second
launch reduces, one program a row. Ties and NaN follow torch: the first maximal index wins, and a NaN counts as
larger than any number (the first NaN wins).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import INTERPRETED
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

CHUNK = 256 if INTERPRETED else 4096


@triton.jit
def _chunk_argmax_kernel(logits_ptr, best_ptr, at_ptr, nan_ptr, V, stride, CHUNK: tl.constexpr):
    """One chunk of one row: its maximum, the first column holding it and its first NaN (V where none)."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride + offs, mask=offs < V, other=float("-inf"))
    top = tl.max(x, axis=0)
    slot = row * tl.num_programs(1) + tl.program_id(1)
    tl.store(best_ptr + slot, top)
    tl.store(at_ptr + slot, tl.min(tl.where(x == top, offs, V), axis=0))  # a chunk of -inf: its first column
    tl.store(nan_ptr + slot, tl.min(tl.where(x != x, offs, V), axis=0))


@triton.jit
def _argmax_kernel(best_ptr, at_ptr, nan_ptr, out_ptr, V, CHUNKS, CHUNKS_PAD: tl.constexpr):
    """A row's chunks in column order: the first NaN if any, else the first chunk holding the maximum's column
    (a row of -inf only: column 0, as torch)."""
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, CHUNKS_PAD)
    ok = chunk < CHUNKS
    best = tl.load(best_ptr + row * CHUNKS + chunk, mask=ok, other=float("-inf"))
    at = tl.load(at_ptr + row * CHUNKS + chunk, mask=ok, other=V)
    first_nan = tl.min(tl.load(nan_ptr + row * CHUNKS + chunk, mask=ok, other=V), axis=0)
    index = tl.min(tl.where(best == tl.max(best, axis=0), at, V), axis=0)
    tl.store(out_ptr + tl.program_id(0), tl.where(first_nan < V, first_nan, index).to(tl.int64))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 rows [T, V] (int64 [T])."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"greedy_tokens takes fp32 [T, V] logits with unit-stride rows, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows and vocab:
        chunks = triton.cdiv(vocab, CHUNK)
        best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        at, first_nan = (torch.empty(rows, chunks, dtype=torch.int32, device=logits.device) for _ in range(2))
        _chunk_argmax_kernel[(rows, chunks)](logits, best, at, first_nan, vocab, logits.stride(0), CHUNK=CHUNK,
                                             num_warps=4, **LAUNCH)
        _argmax_kernel[(rows,)](best, at, first_nan, out, vocab, chunks, CHUNKS_PAD=triton.next_power_of_2(chunks),
                                num_warps=1, **LAUNCH)
    elif rows:
        raise ValueError("greedy_tokens: an empty vocabulary has no argmax")
    return out
