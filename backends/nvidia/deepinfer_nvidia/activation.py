"""The shared expert's clamped SwiGLU in one launch (``MoEBackend.swiglu``): the reference widens both inputs,
clamps, applies silu, multiplies and narrows the result, seven kernels per MoE layer at decode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.minimum(tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32), limit)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(out_ptr + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {list(gate.shape)} and up {list(up.shape)} differ")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if gate.numel():
        _swiglu_kernel[(triton.cdiv(gate.numel(), BLOCK),)](gate, up, out, gate.numel(), float(limit), BLOCK=BLOCK)
    return out
