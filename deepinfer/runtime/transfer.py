"""Copies between host and device that never make the host wait for the device.

A copy from pageable host memory is staged by the driver, which may first synchronize with the stream: with
asynchronous scheduling that stalls the host until the previous step has finished, and the overlap is gone. So
host tensors go to the device from pinned memory. PyTorch's pinned-memory cache records the copy on the stream and
does not hand the staging block out again until the copy has run. (Replayed decode steps keep their own pinned
staging buffers instead, ``runner/cuda_graphs.py``: no allocation per step.)
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """The other way, also without waiting: a pinned copy, complete once the stream has reached it (an event
    recorded after it says when)."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)

