"""Split-K bookkeeping shared by the few-row FP8 kernels (``fp8_linear``, ``fp8_gemv``): each K split keeps its fp32
partial tile apart, and either the last split to arrive on a column tile's counter adds them in split order, or a
second launch does (``sum_splits_kernel``). Both add in the same order, so a call's result does not depend on
which program finished last.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import wait_for_inputs


@triton.jit
def store_split(acc, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, offs_m, n_ok, m_ok, M, N, stride_y,
                 SPLITS: tl.constexpr, SUM_HERE: tl.constexpr):
    """A split's [BN, BM] tile of ``y^T``: stored, or kept apart as a partial. With SUM_HERE, the split counts itself
    in on its column tile's arrival counter and the last to arrive adds the partials in split order into ``y``."""
    out = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = partial_ptr + offs_m[None, :] * N + offs_n[:, None]
        tl.store(tile + split * M * N, acc, mask=mask)
        if SUM_HERE:
            tl.debug_barrier()  # every thread's partial is written before the count says so (release, GPU scope)
            arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                total = tl.load(tile, mask=mask, other=0.0, cache_modifier=".cg")  # from L2: other SMs wrote them
                for s in tl.static_range(1, SPLITS):
                    total += tl.load(tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(arrivals_ptr + pid_n, 0)


@triton.jit
def sum_splits_kernel(partial_ptr, y_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``y`` = the splits' partial sums added in split order (the order ``SUM_HERE`` adds them in)."""
    wait_for_inputs()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(partial_ptr + split * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split GEMM's per-column-tile arrival counters: zero between calls (each call's last split zeroes its
    own), so one buffer per device serves every call in stream order, graph replays included. A wider call gets a
    larger buffer; the smaller ones stay allocated, since captured graphs hold their addresses."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        buffers.append(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


def counters_are_zero(device: torch.device) -> bool:
    """Whether every arrival counter on ``device`` is back at zero (each call's last split resets its own); a
    device no split call has run on has none (KeyError)."""
    return not any(counters.any() for counters in _ARRIVALS[device])


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter: enough to split the tests' small shapes
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count
