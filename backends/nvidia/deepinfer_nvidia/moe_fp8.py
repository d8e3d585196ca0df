"""Routed experts with FP8 weights: e4m3 values with one e8m0 scale per weight tile (DeepSeek-V4-Flash-Base ships its
experts so, in 128 x 128 tiles). ``moe.TritonMoE`` sends them here.

The reference (``TorchMoE`` over ``blockwise_linear``) rounds each expert's input to FP8 in 1 x ``activation_block``
segments and multiplies it by the dequantized weight in fp32. Both paths here round the same way (``act_quant``),
multiply e4m3 by e4m3 on the tensor cores and scale each K chunk's fp32 sum by the two powers of two: the
reference's products, up to fp32 summation order.

- Triton, any tile size: one grouped launch per projection over ``moe``'s expert blocks (w1 and w3 in one launch,
  with SwiGLU), as for the other weight formats. A K chunk spans ``min(activation block, weight tile)`` columns,
  so each row has one activation scale in it and each weight row one scale. On the H200 it streams a decode
  step's experts at 94-98% of the copy rate from 16 tokens on (V4-Flash's widths; 53% at one token).
- DeepGEMM's m-grouped masked FP8 GEMM at decode, on SM100 (the plugin's choice: on the H200 it measured 1.2-2.4x
  slower than the Triton kernel, glue included), where it loaded and the weights have its recipe (128 x 128
  tiles, 1 x 128 activation blocks): each expert gets a slab of ``max_rows`` rows (a token picks an expert once,
  so the step's token count, aligned, always fits) and the rows each expert really has stay on the device
  (``masked_m``). Nothing synchronises with the host, so a CUDA graph can hold it. DeepGEMM writes bf16: gate and
  up are rounded to bf16 before SwiGLU, and w2's output before the top-k sum (the Triton path keeps fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.runtime.quantization import infer_block
from deepinfer_nvidia import activation, moe_blocks
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_linear import _fp32_scales
from deepinfer_nvidia.fp8_rounding import _native_fp8, act_quant
from deepinfer_nvidia.moe_blocks import e8m0_to_fp32

# DeepGEMM's masked GEMM serves steps of up to this many tokens: its slabs hold max_rows rows for every expert
# (at 64 tokens and V4-Flash's 256 experts, 67 MB of FP8 input and 268 MB of bf16 gate and up a layer, reused)
MASKED_MAX_TOKENS = 64
DEEPGEMM_TILE = 128  # DeepGEMM's SM90 FP8 recipe: 1 x 128 activation scales, 128 x 128 weight tiles


@triton.jit
def _fp8_chunk(acc, a, sa, w_ptrs, w_ok, sw_ptrs, n_ok, NATIVE_FP8: tl.constexpr):
    """``acc`` plus one K chunk: e4m3 activations [BM, BK] (row scales ``sa``) times BN e4m3 weight rows, each with
    one e8m0 scale in this chunk."""
    w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    if NATIVE_FP8:
        part = tl.dot(a, tl.trans(w))
    else:  # the interpreter (and GPUs without FP8 tensor cores): the same values in fp32
        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    sw = e8m0_to_fp32(tl.load(sw_ptrs, mask=n_ok, other=127).to(tl.int32) & 0xFF)
    return acc + part * sa[:, None] * sw[None, :]


@triton.jit
def _fp8_experts_kernel(a_ptr, sa_ptr, a_rows_ptr, w_ptr, v_ptr, sw_ptr, sv_ptr, out_ptr, out_rows_ptr,
                        block_expert_ptr, block_start_ptr, block_rows_ptr, N, limit, stride_a, stride_sa, stride_we,
                        stride_wn, stride_swe, stride_swn, stride_out, K: tl.constexpr, ACT_BLOCK: tl.constexpr,
                        ROW_TILE: tl.constexpr, COL_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, SWIGLU: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """out = a W^T for one block of rows and BN columns; with SWIGLU, swiglu(a W^T, a V^T)."""
    wait_for_inputs()
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    w_tile = expert * stride_we + offs_n[:, None] * stride_wn
    s_tile = expert * stride_swe + (offs_n // ROW_TILE) * stride_swn
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        sa = tl.load(sa_ptr + rows * stride_sa + k0 // ACT_BLOCK, mask=m_ok, other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        acc = _fp8_chunk(acc, a, sa, w_ptr + w_tile + k[None, :], w_ok, sw_ptr + s_tile + k0 // COL_TILE, n_ok,
                         NATIVE_FP8)
        if SWIGLU:
            up = _fp8_chunk(up, a, sa, v_ptr + w_tile + k[None, :], w_ok, sv_ptr + s_tile + k0 // COL_TILE, n_ok,
                            NATIVE_FP8)
    moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                           SWIGLU)


def tiles(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """The (rows, columns) of the weight tile each scale covers."""
    return infer_block(weight.shape[-2], scale.shape[-2]), infer_block(weight.shape[-1], scale.shape[-1])


def chunk_columns(weights) -> int:
    """The K chunk of every projection: one activation scale and one weight scale per row in it."""
    return min([weights.activation_block] + [tiles(w, s)[1] for w, s in
                                            ((weights.w1, weights.w1_scale), (weights.w2, weights.w2_scale))])


def triton_serves(weights, device: torch.device) -> bool:
    """FP8 tensor cores multiply 32 columns at a time: a narrower chunk (a tiny test model's tiles) is not served
    natively."""
    return chunk_columns(weights) >= 32 or not _native_fp8(device)


def fp8_experts(a, a_rows, out_rows, w, w_scale, blocks, bm, activation_block, chunk, v=None, v_scale=None,
                limit=0.0):
    """fp32 [len(out_rows), N]: rows of ``a`` (FP8-rounded here) times w, or swiglu of w and v when v is given."""
    aq, sa = act_quant(a.contiguous(), activation_block)
    n, k = w.shape[1], w.shape[2]
    row_tile, col_tile = tiles(w, w_scale)
    out = torch.empty(len(out_rows), n, dtype=torch.float32, device=a.device)
    swiglu = v is not None
    scales = w_scale.view(torch.uint8)  # read as exponents in the kernel
    v_scales = (v_scale if swiglu else w_scale).view(torch.uint8)
    bn = 64 if n >= 64 else 32
    grid = (len(blocks[0]), triton.cdiv(n, bn))
    _fp8_experts_kernel[grid](aq, sa, a_rows, w, v if swiglu else w, scales, v_scales, out, out_rows, *blocks, n, limit,
                              aq.stride(0), sa.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1),
                              out.stride(0), K=k, ACT_BLOCK=activation_block, ROW_TILE=row_tile, COL_TILE=col_tile,
                              BLOCK_M=bm, BN=bn, BK=chunk, SWIGLU=swiglu, NATIVE_FP8=_native_fp8(a.device),
                              num_warps=4, num_stages=3, **LAUNCH)
    return out


def masked_serves(tokens: int, weights) -> bool:
    """A call DeepGEMM's masked GEMM takes: a decode-sized step and DeepGEMM's recipe on every projection."""
    if tokens > MASKED_MAX_TOKENS or weights.activation_block != DEEPGEMM_TILE:
        return False
    pairs = ((weights.w1, weights.w1_scale), (weights.w3, weights.w3_scale), (weights.w2, weights.w2_scale))
    return all(tiles(w, s) == (DEEPGEMM_TILE, DEEPGEMM_TILE) and w.shape[1] % DEEPGEMM_TILE == 0
               and w.shape[2] % DEEPGEMM_TILE == 0 for w, s in pairs)


def _into_slabs(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, slab_rows: int):
    """``values`` and their ``scales`` (one row each per entry of ``rows``, or per token when ``rows`` is [T, k])
    at ``rows`` of ``slab_rows``-row buffers. The other rows are left as they are: each output row of a GEMM reads
    its own input row only, and no one reads the outputs of those."""
    slab_values = values.new_empty(slab_rows, values.shape[-1])
    slab_scales = scales.new_empty(slab_rows, scales.shape[-1])
    if rows.dim() == 2:  # each token's row into its top-k slots
        values, scales = values.unsqueeze(1), scales.unsqueeze(1)
    slab_values.view(torch.uint8)[rows] = values.view(torch.uint8)  # e4m3 has no index_put: its bytes move
    slab_scales[rows] = scales
    return slab_values, slab_scales


def masked_routed_experts(masked_gemm, align: int, x, topk_ids, topk_weights, weights):
    """``TritonMoE.routed_experts`` through ``masked_gemm((a, sfa), (b, sfb), d, masked_m, expected_m)``, the
    contract of DeepGEMM's ``m_grouped_fp8_gemm_nt_masked``: ``d[e, :masked_m[e]] = a[e, :masked_m[e]] b[e]^T``
    with 1 x 128 scales ``sfa`` on ``a`` and 128 x 128 ones ``sfb`` on ``b``, both fp32."""
    tokens, top_k = topk_ids.shape
    experts, inter, hidden = weights.w1.shape
    max_rows = -(-tokens // align) * align
    sorted_ids, order, first_row = moe_blocks.expert_sorted(topk_ids, experts)
    counts = first_row.diff().int()
    expected = -(-tokens * top_k // experts)
    # each assignment's row (in topk_ids.flatten() order) in the slabs: its expert's slab, its rank among its rows
    slab_starts = torch.arange(experts, device=order.device) * max_rows
    slab_row = moe_blocks.rows_from(sorted_ids, order, first_row, slab_starts)
    slabs = experts * max_rows

    def gemm(a, scales, w, w_scale, width):
        d = torch.empty(experts, max_rows, width, dtype=torch.bfloat16, device=x.device)
        masked_gemm((a.view(experts, max_rows, -1), scales.view(experts, max_rows, -1)), (w, _fp32_scales(w_scale)),
                    d, counts, expected)
        return d.view(slabs, width)

    a, sa = _into_slabs(*act_quant(x.contiguous(), DEEPGEMM_TILE), slab_row.view(tokens, top_k), slabs)
    gate = gemm(a, sa, weights.w1, weights.w1_scale, inter)[slab_row]
    up = gemm(a, sa, weights.w3, weights.w3_scale, inter)[slab_row]
    h = activation.swiglu(gate.float(), up.float(), weights.swiglu_limit)
    h, sh = _into_slabs(*act_quant(h, DEEPGEMM_TILE), slab_row, slabs)
    down = gemm(h, sh, weights.w2, weights.w2_scale, hidden)
    return moe_blocks.combine(down[slab_row], topk_weights, x.dtype)
