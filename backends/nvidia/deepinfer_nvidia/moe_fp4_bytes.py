"""MXFP4 routed experts from the checkpoint's byte layout: the kernel for layers the swap-AB kernel (``moe_mxfp4``)
does not take (K not a multiple of 64, N not of 16, a scale above 2) and for batch-invariant mode, whose tiles it pins.

Since Hopper has no FP4 tensor cores, each byte of two e2m1 codes is decoded by moving bits into two fp16
values (the codes times 2^-14), the low nibbles being the even columns and the high ones the odd; on the GPU
``_e2m1_pairs`` does it for two values per 32-bit operation in inline PTX (seven integer ops per four values;
Triton's interpreter runs ``_e2m1_scaled``'s int16 ops per value instead). The FP8-rounded activations come from
``act_quant(..., pairs_apart=True)`` as fp16 (exact), each 32 columns' even ones first, so the kernel loads the two halves
each MMA reads as they are; each 32-column block is two fp16 MMAs with fp32 accumulation, scaled once by its
weight scale (one power of two per 32 columns and row, read four to an int32 word and made fp32 by moving bits),
the activation's and 2^14. Every product is exact, so the result is the reference's up to fp32 summation order.
Integer work per weight value is what bounds this kernel (about six instructions per value in the compiled loop,
against half a byte read), and a decode step has few (expert, column tile) programs, so its tile sizes, warps and
pipeline depth are autotuned per (N, K, rows per block), in the eager run that precedes a graph capture.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import INTERPRETED, moe_blocks
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import act_quant
from deepinfer_nvidia.moe_blocks import e8m0_to_fp32


@triton.jit
def _e2m1_scaled(nibble_bits, SIGN_SHIFT: tl.constexpr, MAGNITUDE_SHIFT: tl.constexpr):
    """fp16 of e2m1 codes times 2^-14, from the int16 bytes holding them: the sign bit moves to fp16's sign and the
    three magnitude bits to the top of fp16's exponent-low/mantissa-high bits. Codes 2..7 land on normal numbers
    (2^(e-15) (1 + m/2)), code 1 (0.5) on the subnormal 2^-15, code 0 on zero: no selects, no float math, five
    integer ops per value."""
    sign = (nibble_bits & (8 << SIGN_SHIFT)) << (12 - SIGN_SHIFT)
    bits = sign | ((nibble_bits & (7 << SIGN_SHIFT)) << MAGNITUDE_SHIFT)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


# PTX for four packed bytes -> their four low-nibble (even-column) and four high-nibble (odd-column) codes as fp16x2
# words, times 2^-14 as _e2m1_scaled places them: a byte permute puts two bytes in the high bytes of a word's
# halves, where a high nibble's sign bit already is fp16's; each code's magnitude bits (and a low nibble's sign)
# then move into place for two values at a time: seven integer ops per four values, which Triton's interpreter
# cannot run (it runs _e2m1_scaled's int16 ops instead).
_E2M1_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 z, t0, t1, m, s;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x1404;
prmt.b32 t1, $4, z, 0x3424;
shl.b32 m, t0, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, t0, 4; and.b32 s, s, 0x80008000; or.b32 $0, m, s;
shl.b32 m, t1, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, t1, 4; and.b32 s, s, 0x80008000; or.b32 $1, m, s;
shr.b32 m, t0, 3; and.b32 m, m, 0x0E000E00; and.b32 s, t0, 0x80008000; or.b32 $2, m, s;
shr.b32 m, t1, 3; and.b32 m, m, 0x0E000E00; and.b32 s, t1, 0x80008000; or.b32 $3, m, s;
}
""")


@triton.jit
def _e2m1_pairs(packed):
    """(even, odd) fp16 codes times 2^-14 of int8 bytes [BN, 16], as ``_e2m1_scaled`` gives them."""
    return tl.inline_asm_elementwise(_E2M1_PAIRS_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.float16, tl.float16),
                                     is_pure=True, pack=4)


@triton.jit
def _e8m0(ptrs, ok):
    """fp32 powers of two from e8m0 exponent bytes."""
    return e8m0_to_fp32(tl.load(ptrs, mask=ok, other=127).to(tl.int32) & 0xFF)


@triton.jit
def _e8m0_of_word(words, BYTE: tl.constexpr):
    """fp32 powers of two from byte BYTE of int32 words holding four e8m0 exponents (one load for four scales)."""
    return e8m0_to_fp32((words >> (8 * BYTE)) & 0xFF)


@triton.jit
def _e2m1_halves(w_ptrs, n_ok, PACKED: tl.constexpr):
    """(even, odd) fp16 codes times 2^-14 of 32 packed columns of BN weight rows [BN, 16]."""
    if PACKED:
        even, odd = _e2m1_pairs(tl.load(w_ptrs, mask=n_ok[:, None], other=0))
    else:  # Triton's interpreter runs no PTX
        packed = tl.load(w_ptrs, mask=n_ok[:, None], other=0).to(tl.int16)  # [BN, 16]
        even = _e2m1_scaled(packed, 0, 9)
        odd = _e2m1_scaled(packed, 4, 5)
    return even, odd


@triton.jit
def _fp4_block(acc, a_even, a_odd, sa, w_ptrs, sw, n_ok, NATIVE: tl.constexpr, PACKED: tl.constexpr):
    """``acc`` plus one 32-column block: activations [R, 16] (e4m3 values in fp16), even columns and odd ones,
    times 32 packed columns of BN weight rows, scaled by the activation's ``sa`` [R] and the weights' ``sw`` [BN]
    powers of two (with the 2^14 the decode leaves out). The low nibbles are the even columns, the high ones the odd:
    two K=16 MMAs instead of interleaving the decoded values."""
    even, odd = _e2m1_halves(w_ptrs, n_ok, PACKED and NATIVE)
    if not NATIVE:  # the interpreter: the same values in fp32
        a_even, a_odd, even, odd = a_even.to(tl.float32), a_odd.to(tl.float32), even.to(tl.float32), odd.to(tl.float32)
    part = tl.dot(a_odd, tl.trans(odd), tl.dot(a_even, tl.trans(even)))
    return acc + part * (sa * 16384.0)[:, None] * sw[None, :]


@triton.jit
def _fp4_rows(a_ptr, sa_ptr, rows, m_ok, w_ptr, v_ptr, sw_ptr, sv_ptr, w_tile, s_tile, n_ok, stride_a, stride_sa,
              K: tl.constexpr, ACT_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              SWIGLU: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr, WORD_SCALES: tl.constexpr):
    """(a W^T, a V^T) [BLOCK_M, BN] in fp32 for the rows ``rows`` of ``a`` (masked by ``m_ok``): fp16 e4m3 values,
    each 32 columns' even ones first (``act_quant``'s ``pairs_apart``). With WORD_SCALES the scale pointers address int32
    words of four e8m0 exponents (128 columns), else bytes."""
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for tile in range(K // BK):
        for block in tl.static_range(BK // 32):  # each 32 columns: one weight scale per row, the sum scaled once
            k0 = tile * BK + block * 32
            if WORD_SCALES and block % 4 == 0:
                w_words = tl.load(sw_ptr + s_tile + k0 // 128, mask=n_ok, other=0x7F7F7F7F)
                if SWIGLU:
                    v_words = tl.load(sv_ptr + s_tile + k0 // 128, mask=n_ok, other=0x7F7F7F7F)
            a_ptrs = a_ptr + rows[:, None] * stride_a + k0 + tl.arange(0, 16)[None, :]  # each 32: even, then odd
            a_even = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            a_odd = tl.load(a_ptrs + 16, mask=m_ok[:, None], other=0.0)
            sa = tl.load(sa_ptr + rows * stride_sa + k0 // ACT_BLOCK, mask=m_ok, other=0.0)
            if WORD_SCALES:
                sw = _e8m0_of_word(w_words, block % 4)
            else:
                sw = _e8m0(sw_ptr + s_tile + k0 // 32, n_ok)
            acc = _fp4_block(acc, a_even, a_odd, sa, w_ptr + w_tile + k0 // 2, sw, n_ok, NATIVE, PACKED)
            if SWIGLU:
                if WORD_SCALES:
                    sv = _e8m0_of_word(v_words, block % 4)
                else:
                    sv = _e8m0(sv_ptr + s_tile + k0 // 32, n_ok)
                up = _fp4_block(up, a_even, a_odd, sa, v_ptr + w_tile + k0 // 2, sv, n_ok, NATIVE, PACKED)
    return acc, up


@triton.jit
def _fp4_experts_kernel(a_ptr, sa_ptr, a_rows_ptr, w_ptr, v_ptr, sw_ptr, sv_ptr, out_ptr, out_rows_ptr,
                        block_expert_ptr, block_start_ptr, block_rows_ptr, N, limit, stride_a, stride_sa, stride_we,
                        stride_wn, stride_swe, stride_swn, stride_out, K: tl.constexpr, ACT_BLOCK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWIGLU: tl.constexpr,
                        NATIVE: tl.constexpr, PACKED: tl.constexpr, WORD_SCALES: tl.constexpr):
    """out = a W^T for one block of rows and BN columns; with SWIGLU, swiglu(a W^T, a V^T)."""
    wait_for_inputs()
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    w_tile = expert * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    s_tile = expert * stride_swe + offs_n * stride_swn
    acc, up = _fp4_rows(a_ptr, sa_ptr, rows, m_ok, w_ptr, v_ptr, sw_ptr, sv_ptr, w_tile, s_tile, n_ok, stride_a,
                        stride_sa, K, ACT_BLOCK, BLOCK_M, BN, BK, SWIGLU, NATIVE, PACKED, WORD_SCALES)
    moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, acc, up, limit,
                           SWIGLU)


# (BN, BK, warps, stages) the MXFP4 kernel's tuner times
FP4_TILE_SHAPES = [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (32, 256, 4, 2),
                   (64, 256, 8, 2), (16, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3)]


@functools.cache
def _tuned_fp4_experts():
    """The MXFP4 kernel autotuned once per (N, K, rows per block, fused w1/w3): column tile, K tile, warps,
    stages."""
    configs = [triton.Config({"BN": bn, "BK": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in FP4_TILE_SHAPES]

    def fitting(configs, named_args, **kwargs):  # K tiles must divide K; K is a keyword (constexpr) argument
        k = kwargs["K"]  # a multiple of 32, the MXFP4 block
        step = 128 if kwargs["WORD_SCALES"] else 32  # a tile reads whole words of four scales
        return ([c for c in configs if k % c.kwargs["BK"] == 0 and c.kwargs["BK"] % step == 0]
                or [triton.Config({"BN": 32, "BK": step}, num_warps=4)])

    return triton.autotune(configs=configs, key=["N", "K", "BLOCK_M", "SWIGLU", "PACKED", "WORD_SCALES"],
                           prune_configs_by={"early_config_prune": fitting})(_fp4_experts_kernel)


# Batch-invariant mode's MXFP4 configuration: a row's 32-column blocks are summed in order whatever the tiles, but
# the tile shape picks the MMA instructions, whose own summation order is unspecified, so the autotuner's choice
# (per rows per block) must not apply.
PINNED_FP4_TILES = {"BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3}


# Switches for tools/gpu/gpu_mxfp4.py: e2m1 codes decoded by _e2m1_pairs' packed PTX (True) or _e2m1_scaled's int16
# ops; scales read four to a word where the rows allow it (True) or a byte at a time
PACKED_E2M1_DECODE = True
WORD_SCALES = True


def _scale_words(scales: torch.Tensor, k: int) -> torch.Tensor | None:
    """The e8m0 scales [E, N, K/32] as int32 words of four, when their rows allow it."""
    if not WORD_SCALES or k % 128 or scales.stride(-1) != 1 or scales.stride(0) % 4 or scales.stride(1) % 4:
        return None
    if scales.storage_offset() % 4 or scales.untyped_storage().data_ptr() % 4:
        return None
    return scales.view(torch.int32)


def experts(a, a_rows, out_rows, w, w_scale, blocks, bm, activation_block, v=None, v_scale=None, limit=0.0,
                 pinned=False):
    """fp32 [len(out_rows), N]: rows of ``a`` (FP8-rounded here) times w, or swiglu of w and v when v is given."""
    aq, sa = act_quant(a.contiguous(), activation_block, pairs_apart=True)
    n, k = w.shape[1], 2 * w.shape[2]
    out = torch.empty(len(out_rows), n, dtype=torch.float32, device=a.device)
    swiglu = v is not None
    # read as exponents in the kernel: no fp32 copy of every expert's scales
    scales, v_scale = w_scale.view(torch.uint8), (v_scale if swiglu else w_scale).view(torch.uint8)
    words = _scale_words(scales, k), _scale_words(v_scale, k)
    word_scales = words[0] is not None and words[1] is not None
    if word_scales:
        scales, v_scale = words
    v = v if swiglu else w

    def grid(meta):
        return len(blocks[0]), triton.cdiv(n, meta["BN"])

    # the interpreter cannot time configurations: it runs one
    if INTERPRETED or a.device.type != "cuda":
        kernel, tiles = _fp4_experts_kernel, {"BN": moe_blocks.column_tile(n), "BK": 128 if k % 128 == 0 else 32}
    elif pinned:
        kernel, tiles = _fp4_experts_kernel, PINNED_FP4_TILES | {"BK": max(bk for bk in (128, 64, 32) if k % bk == 0)}
    else:
        kernel, tiles = _tuned_fp4_experts(), {}
    kernel[grid](aq, sa, a_rows, w, v, scales, v_scale, out, out_rows, *blocks, n, limit, aq.stride(0), sa.stride(0),
                 w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), out.stride(0), K=k,
                 ACT_BLOCK=activation_block, BLOCK_M=bm, SWIGLU=swiglu, NATIVE=a.device.type == "cuda",
                 PACKED=PACKED_E2M1_DECODE, WORD_SCALES=word_scales, **tiles, **LAUNCH)
    return out
