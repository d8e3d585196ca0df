"""Many-row block-FP8 projections as one bf16 GEMM on cuBLAS: the weight expanded to bf16 in a scratch, the activations
rounded to e4m3 values in bf16 (``fp8_rounded``).

Both expansions are exact (an e4m3 value times a power of two is a bf16 value), so cuBLAS multiplies the very values
the reference multiplies and sums them in fp32. With V4.1's 32 x 32 tiles the Triton FP8 GEMM
(``fp8_linear._fp8_gemm_kernel``) must scale and promote every 32-deep product, and on the H200 it ran 3-4x slower
than cuBLAS's bf16 GEMM on the same weights at 192 and 2048 rows (tools/gpu/gpu_fp8_linear.py); expanding the weight
costs three bytes a weight, which many rows amortize: ``fp8_linear.BF16_GEMM_MIN_ROWS`` is where the whole
route (expansion included) was measured faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import fp8_rounded


@triton.jit
def _expand_kernel(w_ptr, sw_ptr, out_ptr, N, K, stride_w, stride_sw, W_ROW_TILE: tl.constexpr,
                   W_COL_TILE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A [BN, BK] tile of the e4m3 weight times its scale tiles, as bf16."""
    wait_for_inputs()
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :], mask=ok, other=0.0)
    scale = tl.load(sw_ptr + (offs_n // W_ROW_TILE)[:, None] * stride_sw + (offs_k // W_COL_TILE)[None, :], mask=ok,
                    other=0.0)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], (w.to(tl.float32) * scale).to(tl.bfloat16), mask=ok)


def expanded_weight(weight: torch.Tensor, scales: torch.Tensor, row_tile: int, column_tile: int) -> torch.Tensor:
    """The e4m3 ``weight`` [N, K] times its fp32 tile ``scales``, as bf16 [N, K] (exact)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    bn, bk = 32, 128
    _expand_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](weight, scales, out, n, k, weight.stride(0),
                                                            scales.stride(0), W_ROW_TILE=row_tile,
                                                            W_COL_TILE=column_tile, BN=bn, BK=bk, **LAUNCH)
    return out


def serves(flat: torch.Tensor, min_rows: int) -> bool:
    """bf16 activations of at least ``min_rows`` rows (fp16 cannot hold every scaled e4m3 value)."""
    return flat.shape[0] >= min_rows and flat.dtype == torch.bfloat16


def bf16_gemm_linear(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, row_tile: int, block: int,
                     y: torch.Tensor) -> None:
    """``y`` = ``flat`` rounded to FP8 in ``1 x block`` segments, times the expanded weight, on cuBLAS."""
    torch.mm(fp8_rounded(flat, block), expanded_weight(weight, scales, row_tile, block).T, out=y)
