"""MXFP4 routed experts with the weights as the MMA's left operand ("swap-AB"), decoded from the layout that
``moe_mxfp4_layout`` repacks them into once.

A decode step gives each expert a handful of tokens, so the experts are a stream of weight bytes: the kernel must
decode e2m1 codes as fast as HBM delivers them (about 30 values per SM clock on an H200). Three choices serve that:

- Swap-AB: a program computes ``W_tile [BN, K] x A^T [K, BM]`` with BN = 64-128 weight rows on the MMA's M side and
  the few tokens on its N side (16 or more), instead of padding the tokens up to M.
- Both operands are exact in bf16, so one bf16 MMA chain over all of K gives the reference's products: an e2m1 code
  times its e8m0 scale is exact in bf16 (1 mantissa bit), and so is an activation the reference rounds to FP8 (an
  e4m3 value times a power of two; ``fp8_rounded``). No per-block rescaling of the accumulators.
- Each 32-bit word of the repacked layout gives four registers of two bf16 values with one AND each for three of
  them (``q & 0x81C081C0``, ``(q << 3) & ...``, ``(q << 6) & ...``) and five ops for the fourth; each value lands as
  ``code x 2^-126`` (its sign at bit 15, its three exponent/mantissa bits at bf16's bits 8..6; code 1, 0.5, is
  bf16's subnormal), and one ``mul.bf16x2`` by ``2^(e - 1)`` per pair applies the scale and the 2^126.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import moe_blocks
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.moe_mxfp4_layout import CHUNK
from deepinfer_nvidia.moe_blocks import e8m0_to_fp32

# Four bf16x2 registers of a repacked word, each pair times its row's and group's scale (2^(e - 1), bf16x2): the bias
# 2^-126 of the decoded values and the e8m0 scale in one multiply. A pack's elements 0, 1 are row r, 2, 3 row r + 8,
# so each scale operand's first register ($5, $7) serves (A0, A1) and (B0, B1), its second ($6, $8) the others.
_DECODE_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, t2;
and.b32 $0, $4, 0x81C081C0;
shl.b32 t0, $4, 3;
and.b32 $1, t0, 0x81C081C0;
shl.b32 t0, $4, 6;
and.b32 $2, t0, 0x81C081C0;
shl.b32 t0, $4, 1;
and.b32 t0, t0, 0x80008000;
shr.b32 t1, $4, 5;
and.b32 t1, t1, 0x01000100;
shr.b32 t2, $4, 4;
and.b32 t2, t2, 0x00C000C0;
or.b32 t0, t0, t1;
or.b32 $3, t0, t2;
mul.rn.bf16x2 $0, $0, $5;
mul.rn.bf16x2 $1, $1, $6;
mul.rn.bf16x2 $2, $2, $7;
mul.rn.bf16x2 $3, $3, $8;
}
""")


@triton.jit
def _scale_bf16(exponents):
    """2^(e - 1) as bf16 from e8m0 exponent bytes (int32, e <= 128): the e8m0 scale times the decode's 2^126."""
    return ((exponents + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _value(word, SIGN: tl.constexpr, E1: tl.constexpr, E0: tl.constexpr, M: tl.constexpr, scale):
    """The interpreter's decode of one value of each word, in fp32 (its bf16 is unreliable) and without the GPU's
    2^-126 bias (the tests flush subnormals): +-2^(e - 1) (1 + m/2), or m/2 for e = 0, times the e8m0 ``scale``."""
    exponent = ((word >> E1) & 1) * 2 + ((word >> E0) & 1)
    half = ((word >> M) & 1).to(tl.float32) * 0.5
    magnitude = tl.where(exponent == 0, half, (1.0 + half) * tl.exp2((exponent - 1).to(tl.float32)))
    return tl.where(((word >> SIGN) & 1) == 1, -magnitude, magnitude) * scale


@triton.jit
def _rows_of_pairs(top, bottom):
    """[BN/2, 32] tiles of rows r and r + 8 of each 16-row block (group g: block g // 8, r = g % 8) -> [BN, 32]."""
    pairs = tl.reshape(tl.join(top, bottom), (top.shape[0] // 8, 8, 32, 2))
    return tl.reshape(tl.permute(pairs, (0, 3, 1, 2)), (2 * top.shape[0], 32))


@triton.jit
def _columns_of_pairs(even, odd):
    """[BN/2, 16] values of columns 2c and 2c + 1 -> [BN/2, 32]."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], 32))


@triton.jit
def _lines(w_ptr, w_base, n0, stride_wn, N, chunk, BN: tl.constexpr, EVEN_N: tl.constexpr):
    """A chunk's repacked bytes for the BN rows from ``n0``: [BN/2, 64], line g holding the words of block g // 8's
    rows r = g % 8 and r + 8 (rows 2r and 2r + 1 of the block in memory). EVEN_N: every row exists (N % BN == 0)."""
    line = tl.arange(0, BN // 2)
    column = tl.arange(0, 64)[None, :]
    block_row = n0 + 16 * (line // 8)
    row = (block_row + 2 * (line % 8))[:, None] + column // 32
    ptrs = w_ptr + w_base + row.to(tl.int64) * stride_wn + chunk * 32 + column % 32
    if EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(block_row < N)[:, None], other=0)


@triton.jit
def _exponents(s_ptr, s_off, n_ok, chunk, EVEN_N: tl.constexpr):
    """The e8m0 exponents (int32) of a chunk's two 32-column blocks for the tile's rows, in one 16-bit load per row:
    ``s_ptr`` is the scales viewed as int16, chunk c's blocks 2c and 2c + 1 its low and high byte."""
    if EVEN_N:
        pair = tl.load(s_ptr + s_off + chunk)
    else:
        pair = tl.load(s_ptr + s_off + chunk, mask=n_ok, other=0x7F7F)
    pair = pair.to(tl.int32)
    return pair & 0xFF, (pair >> 8) & 0xFF


@triton.jit
def _operand_bytes(lines, BN: tl.constexpr):
    """[BN/2, 64] lines -> [BN, 32] bytes at the operand positions each word's bytes decode to
    (``moe_mxfp4_layout.repack``)."""
    return tl.reshape(tl.permute(tl.reshape(lines, (BN // 16, 8, 16, 2, 2)), (0, 3, 1, 2, 4)), (BN, 32))


@triton.jit
def _chunk(w_ptr, w_base, n0, stride_wn, N, exp_a, exp_b, chunk, BN: tl.constexpr, NATIVE: tl.constexpr,
           EVEN_N: tl.constexpr):
    """One 64-column chunk of the BN weight rows from ``n0`` as two [BN, 32] tiles (columns 0-31, 32-63), scaled by
    ``exp_a`` and ``exp_b`` (``_exponents``): bf16 on a GPU, fp32 in the interpreter."""
    lines = _lines(w_ptr, w_base, n0, stride_wn, N, chunk, BN, EVEN_N)
    if NATIVE:
        packed = _operand_bytes(lines, BN)
        a, b = tl.inline_asm_elementwise(
            _DECODE_PTX, "=r,=r,=r,=r,r,r,r,r,r",
            [packed, tl.broadcast_to(_scale_bf16(exp_a)[:, None], packed.shape),
             tl.broadcast_to(_scale_bf16(exp_b)[:, None], packed.shape)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # Triton's interpreter runs no PTX: each word from its four bytes, decoded a value at a time
        low, high = tl.split(tl.reshape(lines.to(tl.int32) & 0xFF, (BN // 2, 16, 2, 2)))  # [line, q, half], by column
        byte0, byte2 = tl.split(low)
        byte1, byte3 = tl.split(high)
        word = byte0 | (byte1 << 8) | (byte2 << 16) | (byte3 << 24)  # [BN/2, 16]
        scale_a, scale_b = e8m0_to_fp32(exp_a), e8m0_to_fp32(exp_b)
        # the scales of each line's rows r and r + 8 (the values are laid out in the same pairs)
        top_a, bottom_a = tl.split(tl.permute(tl.reshape(scale_a, (BN // 16, 2, 8)), (0, 2, 1)))
        top_b, bottom_b = tl.split(tl.permute(tl.reshape(scale_b, (BN // 16, 2, 8)), (0, 2, 1)))
        ta, ba = tl.reshape(top_a, (BN // 2,))[:, None], tl.reshape(bottom_a, (BN // 2,))[:, None]
        tb, bb = tl.reshape(top_b, (BN // 2,))[:, None], tl.reshape(bottom_b, (BN // 2,))[:, None]
        a = _rows_of_pairs(_columns_of_pairs(_value(word, 15, 8, 7, 6, ta), _value(word, 31, 24, 23, 22, ta)),
                           _columns_of_pairs(_value(word, 12, 5, 4, 3, ba), _value(word, 28, 21, 20, 19, ba)))
        b = _rows_of_pairs(_columns_of_pairs(_value(word, 9, 2, 1, 0, tb), _value(word, 25, 18, 17, 16, tb)),
                           _columns_of_pairs(_value(word, 14, 13, 11, 10, bb), _value(word, 30, 29, 27, 26, bb)))
    return a, b


@triton.jit
def _chunk_product(acc, a_ptr, rows, m_ok, stride_a, w_ptr, w_base, n0, stride_wn, N, s_ptr, s_off, n_ok, chunk,
                   BN: tl.constexpr, NATIVE: tl.constexpr, EVEN_N: tl.constexpr):
    """``acc`` plus one 64-column chunk's product."""
    cols = tl.arange(0, 32)
    exp_a, exp_b = _exponents(s_ptr, s_off, n_ok, chunk, EVEN_N)
    w_a, w_b = _chunk(w_ptr, w_base, n0, stride_wn, N, exp_a, exp_b, chunk, BN, NATIVE, EVEN_N)
    a_lo = tl.load(a_ptr + rows[:, None] * stride_a + chunk * 64 + cols[None, :], mask=m_ok[:, None], other=0.0)
    a_hi = tl.load(a_ptr + rows[:, None] * stride_a + chunk * 64 + 32 + cols[None, :], mask=m_ok[:, None], other=0.0)
    if NATIVE:
        acc = tl.dot(w_a, tl.trans(a_lo), acc)
        acc = tl.dot(w_b, tl.trans(a_hi), acc)
    else:  # the interpreter: fp32 products of the same exact values
        acc = tl.dot(w_a, tl.trans(a_lo.to(tl.float32)), acc)
        acc = tl.dot(w_b, tl.trans(a_hi.to(tl.float32)), acc)
    return acc


@triton.jit
def _project(acc, a_ptr, rows, m_ok, stride_a, w_ptr, w_base, n0, stride_wn, N, s_ptr, s_off, n_ok, first,
             CHUNKS: tl.constexpr, UNROLL: tl.constexpr, BN: tl.constexpr, NATIVE: tl.constexpr,
             EVEN_N: tl.constexpr):
    """``acc`` [BN, BM] plus this tile's weight rows times the activation rows ``rows`` [BM], over the CHUNKS
    64-column chunks of K from chunk ``first``, UNROLL of them per loop step."""
    for step in range(CHUNKS // UNROLL):
        for part in tl.static_range(UNROLL):
            acc = _chunk_product(acc, a_ptr, rows, m_ok, stride_a, w_ptr, w_base, n0, stride_wn, N, s_ptr, s_off,
                                 n_ok, first + step * UNROLL + part, BN, NATIVE, EVEN_N)
    return acc


@triton.jit
def _experts_kernel(a_ptr, a_rows_ptr, w_ptr, v_ptr, sw_ptr, sv_ptr, out_ptr, out_rows_ptr, block_expert_ptr,
                    block_start_ptr, block_rows_ptr, N, limit, stride_a, stride_we, stride_wn, stride_se, stride_sn,
                    stride_out, stride_split, K: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
                    SWIGLU: tl.constexpr, SPLITS: tl.constexpr, UNROLL: tl.constexpr, NATIVE: tl.constexpr,
                    EVEN_N: tl.constexpr):
    """out = a W^T for one block of rows (an expert's) and BN columns; with SWIGLU, swiglu(a W^T, a V^T). With K cut
    in SPLITS parts, program (.., .., s) writes part s's sums to ``out[s]`` (and the up projection's to
    ``out[SPLITS + s]``) for ``_reduce_splits``."""
    wait_for_inputs()
    count = tl.load(block_rows_ptr + tl.program_id(0))
    if count == 0:  # a surplus block of the shape-sized grid
        return
    expert, start, offs_m, m_ok, rows, offs_n, n_ok = moe_blocks.block_tile(count, block_expert_ptr, block_start_ptr,
                                                                             a_rows_ptr, N, BLOCK_M, BN)
    n0 = tl.program_id(1) * BN
    s_off = expert * stride_se + offs_n.to(tl.int64) * stride_sn
    chunks: tl.constexpr = K // 64 // SPLITS
    split = tl.program_id(2)
    gate = _project(tl.zeros((BN, BLOCK_M), dtype=tl.float32), a_ptr, rows, m_ok, stride_a, w_ptr, expert * stride_we,
                    n0, stride_wn, N, sw_ptr, s_off, n_ok, split * chunks, chunks, UNROLL, BN, NATIVE, EVEN_N)
    up = gate
    if SWIGLU:
        up = _project(tl.zeros((BN, BLOCK_M), dtype=tl.float32), a_ptr, rows, m_ok, stride_a, v_ptr,
                      expert * stride_we, n0, stride_wn, N, sv_ptr, s_off, n_ok, split * chunks, chunks, UNROLL, BN,
                      NATIVE, EVEN_N)
    if SPLITS == 1:
        moe_blocks.store_block(out_ptr, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, tl.trans(gate),
                               tl.trans(up), limit, SWIGLU)
    else:  # partial sums: the activation waits for all of K
        part = out_ptr + split.to(tl.int64) * stride_split
        moe_blocks.store_block(part, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok, stride_out, tl.trans(gate),
                               tl.trans(gate), limit, False)
        if SWIGLU:
            moe_blocks.store_block(part + SPLITS * stride_split, out_rows_ptr, start, offs_m, m_ok, offs_n, n_ok,
                                   stride_out, tl.trans(up), tl.trans(up), limit, False)


@triton.jit
def _reduce_splits(parts_ptr, out_ptr, N, stride_split, limit, SPLITS: tl.constexpr, SWIGLU: tl.constexpr,
                   BLOCK: tl.constexpr):
    """out[row] = the sum of the SPLITS partial sums of a row (in split order: the same bits every run), or swiglu of
    the gate's and the up projection's sums."""
    wait_for_inputs()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    row = tl.program_id(0).to(tl.int64) * N + offs
    gate = tl.zeros((BLOCK,), tl.float32)
    up = gate
    for split in tl.static_range(SPLITS):
        gate += tl.load(parts_ptr + split * stride_split + row, mask=ok, other=0.0)
        if SWIGLU:
            up += tl.load(parts_ptr + (SPLITS + split) * stride_split + row, mask=ok, other=0.0)
    if SWIGLU:
        gate = moe_blocks.swiglu(gate, up, limit)
    tl.store(out_ptr + row, gate, mask=ok)


# (BN weight rows, warps, pipeline stages, chunks per loop step) per rows-per-block bucket, the fastest of
# tools/gpu/gpu_mxfp4.py's sweep on the H200 (BENCHMARKS.md). Four chunks a step spread the pipeline's per-step
# bookkeeping (stage indices, a barrier, loop control) over 256 columns: 119 SASS per chunk in the 16-row loop against
# 151 at one chunk a step (ptxas 12.8), and 1.15x the speed at 16-64 tokens with two stages (three measured 12% slower
# there). The 64-row tile keeps one chunk a step: four would take 180 KB of shared memory (one program per SM). With
# 64-row blocks, BN = 64 and 4 warps gave non-finite, unrepeatable results under Triton 3.6's ptxas 12.8 (the
# register-operand wgmma hazard that CUDA 13.3's ptxas fixes): 128-row tiles only there.
TILES = {16: (64, 4, 2, 4), 64: (128, 8, 4, 1)}


# A launch with fewer programs than this many per SM leaves the SMs' schedulers short of warps to hide the decode's
# latency (a batch-1 step has 6 experts' tiles: 216 programs for w1/w3 on 132 SMs): K is then cut in parts, their
# partial sums added by a second launch. tools/gpu/gpu_mxfp4.py --sweep times other values.
PROGRAMS_PER_SM = 4


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def splits(programs: int, chunks: int, sms: int) -> int:
    """Parts to cut K's ``chunks`` into for a launch of ``programs`` programs on ``sms`` SMs: the largest divisor of
    ``chunks`` up to the factor that brings the launch to PROGRAMS_PER_SM programs per SM."""
    wanted = -(-PROGRAMS_PER_SM * sms // max(programs, 1))
    return max(d for d in range(1, min(wanted, chunks) + 1) if chunks % d == 0)


def experts(a: torch.Tensor, a_rows, out_rows, w, w_scale, blocks, bm: int, v=None, v_scale=None,
            limit: float = 0.0) -> torch.Tensor:
    """fp32 [len(out_rows), N]: rows of the bf16 activations ``a`` (already FP8-rounded) times the repacked w, or
    swiglu of w and v when v is given; ``blocks`` and ``bm`` as ``moe`` builds them (bm >= 16)."""
    n, k = w.shape[1], 2 * w.shape[2]
    rows = len(out_rows)
    out = torch.empty(rows, n, dtype=torch.float32, device=a.device)
    swiglu = v is not None
    native = a.device.type == "cuda"
    scales = w_scale.view(torch.int16)  # a chunk's two exponents in one load (_exponents)
    v_scales = (v_scale if swiglu else w_scale).view(torch.int16)
    bn, warps, stages, unroll = TILES[bm]
    # programs with rows: at most one block per assignment and per expert (the routing decides which)
    busy = min(len(blocks[0]), rows, w.shape[0]) * triton.cdiv(n, bn)
    parts = splits(busy, k // CHUNK, _sms(a.device))
    partial = out if parts == 1 else torch.empty((2 if swiglu else 1) * parts, rows, n, dtype=torch.float32,
                                                  device=a.device)
    grid = (len(blocks[0]), triton.cdiv(n, bn), parts)
    while (k // CHUNK // parts) % unroll:
        unroll //= 2
    tuning = {"num_warps": warps, "num_stages": stages} if native else {}
    v = v if swiglu else w
    _experts_kernel[grid](a, a_rows, w, v, scales, v_scales, partial, out_rows, *blocks, n, limit,
                          a.stride(0), w.stride(0), w.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
                          rows * n, K=k, BLOCK_M=bm, BN=bn, SWIGLU=swiglu, SPLITS=parts, UNROLL=unroll, NATIVE=native,
                          EVEN_N=n % bn == 0, **tuning, **LAUNCH)
    if parts > 1 and rows:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_splits[(rows, triton.cdiv(n, block))](partial, out, n, rows * n, limit, SPLITS=parts, SWIGLU=swiglu,
                                                      BLOCK=block, **LAUNCH)
    return out


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, rows, stride_wr, stride_sr, K: tl.constexpr, ROWS: tl.constexpr):
    """ROWS repacked weight rows (of all experts, flattened: 16-row blocks never straddle two) -> bf16 [ROWS, K], the
    grouped GEMM's operand, a 64-column chunk at a time with the interpreter's decode (plain Triton, no PTX)."""
    wait_for_inputs()
    n0 = tl.program_id(0) * ROWS
    row = n0 + tl.arange(0, ROWS)
    ok = row < rows
    row = row.to(tl.int64)
    cols = tl.arange(0, 32)
    for chunk in range(K // 64):
        exp_a, exp_b = _exponents(s_ptr, row * stride_sr, ok, chunk, False)
        a, b = _chunk(w_ptr, 0, n0, stride_wr, rows, exp_a, exp_b, chunk, ROWS, False, False)
        base = out_ptr + row[:, None] * K + chunk * 64 + cols[None, :]
        tl.store(base, a.to(tl.bfloat16), mask=ok[:, None])
        tl.store(base + 32, b.to(tl.bfloat16), mask=ok[:, None])


def dequantize(repacked: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Repacked MXFP4 experts [E, N, K/2] with their scales [E, N, K/32] -> bf16 [E, N, K], exact (into ``out``'s
    first E experts when given)."""
    experts, rows, half = repacked.shape
    if out is None:
        out = torch.empty(experts, rows, 2 * half, dtype=torch.bfloat16, device=repacked.device)
    if experts * rows:
        tile_rows = 16
        _dequant_kernel[(triton.cdiv(experts * rows, tile_rows),)](
            repacked, scales.view(torch.int16), out, experts * rows, half, 2 * half // 64, K=2 * half,
            ROWS=tile_rows, **LAUNCH)
    return out[:experts]
