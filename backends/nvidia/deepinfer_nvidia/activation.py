"""The shared expert's clamped SwiGLU in one launch (``MoEBackend.swiglu``): the reference widens both inputs,
clamps, applies silu, multiplies and narrows the result, seven kernels per MoE layer at decode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gate_ptr, stride_gate, up_ptr, stride_up, out_ptr, n, limit, BLOCK: tl.constexpr):
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.minimum(tl.load(gate_ptr + row * stride_gate + offs, mask=ok, other=0.0).to(tl.float32), limit)
    up = tl.load(up_ptr + row * stride_up + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(out_ptr + row * n + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, width] with unit column stride: the slices of a fused projection's output keep their row
    stride (no copy)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.contiguous().view(-1, x.shape[-1])


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {list(gate.shape)} and up {list(up.shape)} differ")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        gate, up = _rows(gate), _rows(up)
        width = gate.shape[1]
        _swiglu_kernel[(gate.shape[0], triton.cdiv(width, BLOCK))](gate, gate.stride(0), up, up.stride(0), out, width,
                                                                  float(limit), BLOCK=BLOCK, **LAUNCH)
    return out
