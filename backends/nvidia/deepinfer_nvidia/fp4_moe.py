"""Routed experts with MXFP4 weights in Triton: the weights stream from memory packed and are decoded in the kernel.

Hopper has no FP4 tensor cores, so each 32-column chunk of e2m1 codes is decoded to bf16 (exact), multiplied by the
FP8-rounded activations (exact in bf16 too) on the bf16 tensor cores with fp32 accumulation, and added with its two
power-of-two scales: the activation's (one per ``activation_block``) and the weight's (one per 32). So the result
is the reference's (``deepinfer.core.ops``) up to fp32 summation order.

Assignments (token, expert) are sorted by expert and cut into blocks of ``BM`` rows that each belong to one expert;
one grouped GEMM launch serves all experts for each of w1, w3 and w2.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from deepinfer.core.ops import swiglu
from deepinfer.logger import init_logger, log_once
from deepinfer_nvidia.fp8_linear import act_quant

logger = init_logger(__name__)

BM = 16  # rows per block: the few tokens each expert gets at decode fill one MMA tile
MX = 32


@triton.jit
def _e2m1(code):
    """e2m1 value of a 4-bit code (bit 3 is the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _grouped_fp4_gemm_kernel(a_ptr, sa_ptr, rows_ptr, w_ptr, sw_ptr, out_ptr, block_expert_ptr, block_start_ptr,
                             block_rows_ptr, N, K: tl.constexpr, stride_a, stride_sa, stride_we, stride_wn,
                             stride_swe, stride_swn, stride_out, ACT_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                             BN: tl.constexpr, NATIVE: tl.constexpr):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    start = tl.load(block_start_ptr + block)
    count = tl.load(block_rows_ptr + block)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=m_ok, other=0)  # which row of ``a`` each assignment reads
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_k = tl.arange(0, 32)
    offs_byte = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for chunk in range(K // 32):
        k = chunk * 32 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=m_ok[:, None], other=0.0)
        packed = tl.load(w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + chunk * 16 + offs_byte[None, :],
                         mask=n_ok[:, None], other=0).to(tl.int32) & 0xFF
        w = tl.reshape(tl.join(_e2m1(packed & 0xF), _e2m1(packed >> 4)), (BN, 32))  # low nibble = even column
        if NATIVE:  # both operands are exact in bf16: its tensor cores, fp32 accumulation
            part = tl.dot(a.to(tl.float32).to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:  # Triton's interpreter has no bf16 arithmetic
            part = tl.dot(a.to(tl.float32), tl.trans(w))
        sa = tl.load(sa_ptr + rows * stride_sa + (chunk * 32) // ACT_BLOCK, mask=m_ok, other=0.0)
        exponent = tl.load(sw_ptr + expert * stride_swe + offs_n * stride_swn + chunk, mask=n_ok, other=127)
        sw = tl.exp2((exponent.to(tl.int32) - 127).to(tl.float32))  # e8m0: the byte is the biased exponent
        acc += part * sa[:, None] * sw[None, :]
    tl.store(out_ptr + (start + offs_m)[:, None] * stride_out + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def _blocks(topk_ids: torch.Tensor, experts: int):
    """Sorted assignment order and, per block of BM rows, its expert, first sorted row and row count."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    per_expert = (counts + BM - 1) // BM
    expert_of_block = torch.repeat_interleave(torch.arange(experts, device=topk_ids.device), per_expert)
    first_row = torch.cumsum(counts, 0) - counts  # of each expert's segment in sorted order
    first_block = torch.cumsum(per_expert, 0) - per_expert
    index_in_expert = torch.arange(len(expert_of_block), device=topk_ids.device) - first_block[expert_of_block]
    start = first_row[expert_of_block] + index_in_expert * BM
    rows = torch.clamp(counts[expert_of_block] - index_in_expert * BM, max=BM)
    return order, expert_of_block.int(), start.int(), rows.int()


def _grouped_gemm(a, sa, rows, weight, scale, blocks, activation_block):
    expert_of_block, start, count = blocks
    n = weight.shape[1]
    k = 2 * weight.shape[2]
    out = torch.empty(len(rows), n, dtype=torch.float32, device=a.device)
    scales = scale.view(torch.uint8)  # read as exponents in the kernel: no fp32 copy of every expert's scales
    bn = 64 if n >= 64 else 32
    grid = (len(expert_of_block), triton.cdiv(n, bn))
    _grouped_fp4_gemm_kernel[grid](a, sa, rows, weight, scales, out, expert_of_block, start, count, n, k,
                                   a.stride(0), sa.stride(0), weight.stride(0), weight.stride(1), scales.stride(0),
                                   scales.stride(1), out.stride(0), ACT_BLOCK=activation_block, BLOCK_M=BM, BN=bn,
                                   NATIVE=a.device.type == "cuda")
    return out


class TritonMoE:
    name = "triton-mxfp4"

    def __init__(self, reference):
        self.reference = reference  # serves float and FP8 experts, which no release ships

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        if weights.w1.dtype != torch.int8:
            log_once(logger, logging.WARNING, "float or FP8 routed experts: no Triton kernel, the torch reference runs them")
            return self.reference.routed_experts(x, topk_ids, topk_weights, weights)
        block = weights.activation_block
        top_k = topk_ids.shape[1]
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        order, *blocks = _blocks(topk_ids, weights.w1.shape[0])
        token_of = (order // top_k).int()
        xq, sx = act_quant(x.contiguous(), block)
        gate = _grouped_gemm(xq, sx, token_of, weights.w1, weights.w1_scale, blocks, block)
        up = _grouped_gemm(xq, sx, token_of, weights.w3, weights.w3_scale, blocks, block)
        hq, sh = act_quant(swiglu(gate, up, weights.swiglu_limit), block)
        identity = torch.arange(len(order), dtype=torch.int32, device=x.device)
        down = _grouped_gemm(hq, sh, identity, weights.w2, weights.w2_scale, blocks, block)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of.long(), down * topk_weights.flatten()[order].unsqueeze(-1))
        return out.to(x.dtype)
