"""RMSNorm in one launch: the reference (``deepinfer.runtime.ops.rms_norm``) widens a bf16 input to fp32, normalizes
and narrows it back, three kernels per norm and three norms per attention layer at decode."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

MAX_WIDTH = 1 << 15


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, weight_ptr, out_ptr, D, eps, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr):
    wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    if WEIGHTED:
        y = y * tl.load(weight_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * D + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if width > MAX_WIDTH:
        raise ValueError(f"the Triton RMSNorm keeps a row in registers: width {width} is over {MAX_WIDTH}")
    if weight is not None and (weight.dtype != torch.float32 or weight.shape != (width,)):
        raise ValueError(f"the RMSNorm weight must be fp32 [{width}], got {weight.dtype} {tuple(weight.shape)}")
    if x.dim() != 2 or x.stride(-1) != 1:  # rows of a fused projection's output keep their stride
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.numel() // max(1, width)
    if rows:
        block = triton.next_power_of_2(width)
        stride = x.stride(0) if x.dim() == 2 else width
        _rms_norm_kernel[(rows,)](x, stride, x if weight is None else weight.contiguous(), out, width, eps, BLOCK_D=block,
                                  WEIGHTED=weight is not None, num_warps=min(16, max(4, block // 1024)), **LAUNCH)
    return out
