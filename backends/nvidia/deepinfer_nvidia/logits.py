"""fp32 logits from a bf16 vocabulary head without an fp32 copy of it (``LinearBackend.logits``).

DeepSeek-V4.1 ships its head in bf16 and computes logits in fp32. An fp32 copy of the head doubles the bytes every
decode step reads (2.6 GB for V4.1-Flash's 129280 x 5120 head, 629 µs a step on an H200 by cuBLAS's fp32 GEMV,
1.7 ms at batch 64 by its fp32 GEMM). Here the head stays bf16 and the hidden states are split into three bf16
terms, ``x = hi + mid + lo`` (24 significant bits: fp32's), each multiplied by the weight tile on bf16 tensor cores
with fp32 accumulation. The split is exact (each rounding's remainder has at most the bits the next term holds),
and so is a product of two bf16 values in fp32: the result is the fp32 product up to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import INTERPRETED
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs


@triton.jit(do_not_specialize=["M"])  # counts of a step's rows: one binary for any
def _bf16_logits_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr):
    wait_for_inputs()
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.trans(tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + k[None, :],
                             mask=n_ok[:, None] & k_ok[None, :], other=0.0))
        if NATIVE:  # the smaller terms first
            hi = x.to(tl.bfloat16)
            rest = x - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            acc = tl.dot((rest - mid.to(tl.float32)).to(tl.bfloat16), w, acc)
            acc = tl.dot(mid, w, acc)
            acc = tl.dot(hi, w, acc)
        else:  # Triton's interpreter has no bf16 arithmetic: the same fp32 products directly
            acc = tl.dot(x, w.to(tl.float32), acc)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


# (BN, BK, warps, stages): a decode step's few rows stream the head once; 64-row tiles keep a batch's rows on one
# read of it too
DECODE_TILES = {"BM": 16, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4}
BATCH_TILES = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3}


def bf16_logits(hidden: torch.Tensor, weight: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``hidden`` [T, C] fp32 times a bf16 ``weight`` [V, C]: fp32 [T, V]. ``pinned`` keeps one tile shape whatever
    T (batch-invariant mode: tile heights pick different MMA instructions)."""
    if hidden.dtype != torch.float32 or weight.dtype != torch.bfloat16:
        raise ValueError(f"bf16_logits takes fp32 hidden states and a bf16 weight, not {hidden.dtype}, {weight.dtype}")
    hidden = hidden.contiguous()
    rows, (vocab, width) = hidden.shape[0], weight.shape
    out = torch.empty(rows, vocab, dtype=torch.float32, device=hidden.device)
    if not rows:
        return out
    tiles = DECODE_TILES if pinned or rows <= 16 else BATCH_TILES
    if INTERPRETED:
        tiles = {**tiles, "BN": 32, "num_stages": 1}
    grid = (triton.cdiv(rows, tiles["BM"]), triton.cdiv(vocab, tiles["BN"]))
    _bf16_logits_kernel[grid](hidden, weight, out, rows, vocab, width, hidden.stride(0), weight.stride(0),
                              out.stride(0), NATIVE=hidden.device.type == "cuda", **tiles, **LAUNCH)
    return out
