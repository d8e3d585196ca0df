"""RoPE in one launch (``AttentionBackend.rotate``).

The reference (``deepinfer.runtime.ops.rotate_pairs``) widens the rope channels, makes them contiguous complex
numbers, multiplies, narrows and concatenates: about five kernels per call, and a V4 attention layer makes four
to six calls per step (queries, the new kv row, the output's inverse rotation, compressed entries, the indexer's
queries). Here one program per (token, head) copies the row and rotates its trailing pairs in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs


@triton.jit
def _rotate_kernel(x_ptr, stride_xt, stride_xh, phases_ptr, stride_pt, out_ptr, stride_ot, stride_oh, D, NOPE_PAIRS,
                   INVERSE: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pair = tl.arange(0, BLOCK_PAIRS)
    ok = pair < D // 2
    row = x_ptr + token * stride_xt + head * stride_xh
    even = tl.load(row + 2 * pair, mask=ok, other=0.0).to(tl.float32)
    odd = tl.load(row + 2 * pair + 1, mask=ok, other=0.0).to(tl.float32)
    rope = ok & (pair >= NOPE_PAIRS)
    phase = phases_ptr + token * stride_pt + 2 * (pair - NOPE_PAIRS)  # [cos, sin] of each rope pair
    cos = tl.load(phase, mask=rope, other=1.0)
    sin = tl.load(phase + 1, mask=rope, other=0.0)
    if INVERSE:
        sin = -sin
    out = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out + 2 * pair, (even * cos - odd * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + 2 * pair + 1, (even * sin + odd * cos).to(out_ptr.dtype.element_ty), mask=ok)


def rotate(x: torch.Tensor, phases: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """``AttentionBackend.rotate``."""
    dim = x.shape[-1]
    if rope_dim % 2 or rope_dim > dim or dim % 2 or phases.shape[-1] * 2 != rope_dim:
        raise ValueError(f"RoPE over the last {rope_dim} of {dim} channels with {phases.shape[-1]} phases")
    rows = x if x.dim() == 3 else x.unsqueeze(1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    pairs = torch.view_as_real(phases.resolve_conj())  # [T, rope_dim/2, 2] fp32: cos, sin
    if pairs.stride(-1) != 1 or pairs.stride(-2) != 2:
        pairs = pairs.contiguous()
    tokens, heads = rows.shape[:2]
    if tokens:
        _rotate_kernel[(tokens, heads)](rows, rows.stride(0), rows.stride(1), pairs, pairs.stride(0), out,
                                        out.stride(0), out.stride(1), dim, (dim - rope_dim) // 2, INVERSE=inverse,
                                        BLOCK_PAIRS=triton.next_power_of_2(dim // 2), **LAUNCH)
    return out.view(x.shape)
