"""Routed experts in Triton, one grouped GEMM launch per projection for all experts: packed MXFP4 weights (what the
releases ship), FP8 ones (V4-Flash-Base; ``moe_fp8``) or float ones (bf16, fp16, fp32: tiny and converted models).

Assignments (token, expert) are sorted by expert and cut into blocks of ``bm`` rows (16 at decode, 64 in long
prefills) that each belong to one expert (``moe_blocks`` builds that table in one launch at decode). How many blocks
there are depends on the routing, which only the GPU knows; waiting for it would stall the host and forbid CUDA
graphs. So the grid has a bound computed from shapes alone (each expert's last block may be partial:
``ceil(T*k / bm) + min(E, T*k)``) and the surplus blocks get 0 rows and return before reading any weight. Nothing in
``routed_experts`` synchronises with the host or has a data-dependent shape: it can be captured in a CUDA graph and
replayed with other routing.

w1 and w3 share one launch: each block reads its activation tile once for both weights and writes
``swiglu(gate, up)`` (``deepinfer.runtime.ops``). w2 reads those rows in expert order and writes each result to its
(token, slot) row, so the top-k sum is a plain reduction rather than a scatter.

MXFP4: layers whose shapes and scales allow it are repacked on first use and served by ``moe_mxfp4``'s swap-AB
kernel (1.5x the byte-layout kernel at decode on an H200, BENCHMARKS.md); ``moe_fp4_bytes``'s byte-layout kernel
serves the others (K not a multiple of 64, N not of 16, a scale above 2) and batch-invariant mode, whose tiles it
pins. Where humming-kernels is installed, it serves the MXFP4 layers it takes instead (``moe_humming``: measured
faster than the swap-AB kernel on SM90, BENCHMARKS.md), in its own layout of the same bytes.

Float weights: the reference (``project``) multiplies in fp32. Here activations are rounded to the weight's dtype
for its tensor cores, with fp32 accumulation; for bf16/fp16 weights that rounds SwiGLU's fp32 output (and ``x`` if
its dtype differs), fp32 weights get a full-precision dot rather than TF32.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia import (activation, moe_blocks, moe_fp4_bytes, moe_fp8, moe_grouped, moe_humming, moe_mxfp4,
                              moe_mxfp4_layout, routing)
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import fp8_rounded

logger = init_logger(__name__)

# Rows per block: the few tokens each expert gets at decode fill one 16-row MMA tile; in a long prefill each expert
# gets hundreds, and 64-row blocks read each expert's weights a quarter as often.
SMALL_BM, LARGE_BM = 16, 64


def block_rows(assignments: int, experts: int) -> int:
    return LARGE_BM if assignments >= 32 * experts else SMALL_BM
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _float_chunk(acc, a, w_ptrs, mask, NATIVE: tl.constexpr):
    """``acc`` plus ``a`` [BM, BK] times one BK-deep tile of weight rows."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if not NATIVE:  # the interpreter has no bf16 arithmetic (and rounds to it wrongly): unrounded fp32 products
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    elif w.dtype == tl.float32:  # what fp32 weights are for: the reference's precision, not TF32's
        acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
    return acc


@triton.jit
def _float_experts_kernel(a_ptr, a_rows_ptr, w_ptr, v_ptr, out_ptr, out_rows_ptr, block_expert_ptr, block_start_ptr,
                          block_rows_ptr, N, limit, stride_a, stride_we, stride_wn, stride_out, K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr,
                          NATIVE: tl.constexpr):
    """The same as ``moe_fp4_bytes``' kernel for float weights: plain BK-deep tiles, no scales."""
    wait_for_inputs()
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    w_tile = expert * stride_we + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        acc = _float_chunk(acc, a, w_ptr + w_tile + k[None, :], w_ok, NATIVE)
        if SWIGLU:
            up = _float_chunk(up, a, v_ptr + w_tile + k[None, :], w_ok, NATIVE)
    moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                           SWIGLU)


def _grid(blocks, n):
    bn = moe_blocks.column_tile(n)
    return (len(blocks[0]), triton.cdiv(n, bn)), bn


def _float_experts(a, a_rows, out_rows, w, blocks, bm, v=None, limit=0.0):
    """As ``_fp4_experts`` for float weights, with the activations as they are."""
    a = a.contiguous()
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(len(out_rows), n, dtype=torch.float32, device=a.device)
    grid, bn = _grid(blocks, n)
    _float_experts_kernel[grid](a, a_rows, w, w if v is None else v, out, out_rows, *blocks, n, limit, a.stride(0),
                                w.stride(0), w.stride(1), out.stride(0), K=k, BLOCK_M=bm, BN=bn, BK=64,
                                SWIGLU=v is not None, NATIVE=a.device.type == "cuda", **LAUNCH)
    return out


class TritonMoE:
    name = "triton"
    graph_safe = True

    def __init__(self, reference, pinned: bool = False, grouped_gemm=None, grouped_align: int = 0,
                 masked_gemm=None, masked_align: int = 0, repack_fp4: bool = True, humming: bool = False):
        self.reference = reference  # serves what no kernel here takes (weights of other formats), with a warning
        self.pinned = pinned  # 16-row blocks and one tile configuration whatever the batch (batch-invariant mode)
        self.batch_invariant = pinned
        # MXFP4 experts repacked in place for moe_mxfp4 (False: the byte layout's kernel); batch-invariant mode keeps
        # the byte layout's pinned tiles
        self.repack_fp4 = repack_fp4
        # DeepGEMM's m_grouped_bf16_gemm_nt_contiguous and its M alignment: long prefills (moe_grouped); its
        # m_grouped_fp8_gemm_nt_masked and its M alignment: FP8 experts at decode (moe_fp8)
        self.grouped_gemm, self.grouped_align = (None, 0) if pinned else (grouped_gemm, grouped_align)
        self.masked_gemm, self.masked_align = (None, 0) if pinned else (masked_gemm, masked_align)
        # humming-kernels for the MXFP4 layers it serves (moe_humming), where it is installed
        self.humming = humming and not pinned
        if pinned:
            self.name = "triton, pinned tiles (batch-invariant)"
        elif grouped_gemm is not None:
            self.name = "triton; DeepGEMM's grouped GEMM in long prefills" + (
                " and its masked FP8 GEMM for FP8 experts at decode" if masked_gemm is not None else "")
        if self.humming:
            self.name += "; humming-kernels for MXFP4 experts"

    def _takes_humming(self, weights) -> bool:
        """Whether humming serves this MXFP4 layer: decided on its first call (then its tensors carry the layout's
        mark) and logged once per layer shape when it does not."""
        mark = getattr(weights.w1, moe_mxfp4_layout.LAYOUT_ATTRIBUTE, None)
        if mark is not None:
            return mark == moe_humming.HUMMING_LAYOUT
        if not self.humming:
            return False
        reason = moe_humming.serves(weights)
        if reason is not None:
            log_once(logger, logging.INFO, f"MXFP4 experts {tuple(weights.w1.shape)}: {reason}; Triton serves them")
        return reason is None

    def route(self, x, token_ids, router):
        return routing.route(x, token_ids, router, pinned=self.pinned)

    def swiglu(self, gate, up, limit):
        return activation.swiglu(gate, up, limit)

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        w1, w3, w2 = weights.w1, weights.w3, weights.w2
        fp4 = w1.dtype == torch.int8
        fp8 = w1.dtype == torch.float8_e4m3fn and weights.w1_scale is not None
        if fp8:
            served = moe_fp8.triton_serves(weights, x.device)
        else:
            served = fp4 or (weights.w1_scale is None and w1.dtype in FLOAT_DTYPES)
        if not served:
            narrow = " in tiles under 32 columns" if fp8 else ""
            log_once(logger, logging.WARNING, f"{w1.dtype} routed experts{narrow}: no Triton kernel, the torch "
                                              "reference runs them (slower, and it syncs with the host: no CUDA graphs)")
            return self.reference.routed_experts(x, topk_ids, topk_weights, weights)
        # the kernels address w1's and w3's tiles with one set of strides, unit along a row
        pairs = [(w1, w3)] + ([(weights.w1_scale, weights.w3_scale)] if fp4 or fp8 else [])
        if any(a.stride() != b.stride() for a, b in pairs) or w1.stride(-1) != 1 or w2.stride(-1) != 1:
            raise ValueError("routed experts: w1 and w3 (and their scales) need equal strides, and rows unit ones")
        tokens = topk_ids.shape[0]
        if tokens == 0:
            return torch.zeros_like(x)
        if fp8 and self.masked_gemm is not None and moe_fp8.masked_serves(tokens, weights):
            return moe_fp8.masked_routed_experts(self.masked_gemm, self.masked_align, x, topk_ids, topk_weights,
                                                 weights)
        if fp4 and self._takes_humming(weights):
            return moe_humming.routed_experts(weights, x, topk_ids, topk_weights)
        if self.grouped_gemm is not None and moe_grouped.serves(topk_ids.numel(), weights):
            return moe_grouped.routed_experts(self.grouped_gemm, self.grouped_align, x, topk_ids, topk_weights, weights)
        bm = SMALL_BM if self.pinned else block_rows(topk_ids.numel(), w1.shape[0])
        order, token_of, sorted_rows, blocks = moe_blocks.assignment_blocks(topk_ids, w1.shape[0], bm)
        limit = weights.swiglu_limit
        if fp8:
            block, chunk = weights.activation_block, moe_fp8.chunk_columns(weights)
            h = moe_fp8.fp8_experts(x, token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, block, chunk, w3,
                                    weights.w3_scale, limit)
            down = moe_fp8.fp8_experts(h, sorted_rows, order, w2, weights.w2_scale, blocks, bm, block, chunk)
        elif fp4 and not self.pinned and self.repack_fp4 and moe_mxfp4_layout.prepare(weights) is None:
            block = weights.activation_block
            h = moe_mxfp4.experts(fp8_rounded(x, block), token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, w3,
                                  weights.w3_scale, limit)
            down = moe_mxfp4.experts(fp8_rounded(h, block), sorted_rows, order, w2, weights.w2_scale, blocks, bm)
        elif fp4:
            block = weights.activation_block
            h = moe_fp4_bytes.experts(x, token_of, sorted_rows, w1, weights.w1_scale, blocks, bm, block, w3,
                                      weights.w3_scale, limit, self.pinned)
            down = moe_fp4_bytes.experts(h, sorted_rows, order, w2, weights.w2_scale, blocks, bm, block,
                                         pinned=self.pinned)
        else:
            h = _float_experts(x, token_of, sorted_rows, w1, blocks, bm, w3, limit)
            down = _float_experts(h, sorted_rows, order, w2, blocks, bm)
        return moe_blocks.combine(down, topk_weights, x.dtype)
