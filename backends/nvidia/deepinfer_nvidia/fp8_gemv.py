"""One-row block-FP8 projections (a batch-1 decode step's) on the CUDA cores: ``_fp8_gemv_kernel`` reads each
weight row's bytes as whole 32-bit words, widens them to fp32 and meets the bf16 activations, rounded to e4m3 in
1 x ``BK`` segments as ``act_quant`` rounds them (or unrounded, for the grouped ``wo_a`` that the release
dequantizes when it loads). At one row the tensor cores would pad the row to 8 or 16 and the weight stream, not the
arithmetic, bounds the call; this kernel issues fewer instructions a byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_nvidia import INTERPRETED
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import _e4m3_values, _native_fp8, _segment_scale
from deepinfer_nvidia.split_k import arrival_counters, sm_count, store_split


# A 32-bit word of four e4m3 bytes to four fp32 values: two pair conversions and four widenings (1.5 instructions a
# byte). Triton's own conversion of byte tensors picks each byte out and re-pairs them first (about 4).
_E4M3X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def _word_bytes(words, NATIVE_FP8: tl.constexpr):
    """The four e4m3 values (lowest byte first) of each int32 word, as fp32."""
    if NATIVE_FP8:
        return tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [words],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    return (_byte_value(words, 0), _byte_value(words, 8), _byte_value(words, 16), _byte_value(words, 24))


@triton.jit
def _byte_value(words, shift: tl.constexpr):
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_word(words, shift: tl.constexpr):
    """The bf16 value at bit ``shift`` of each int64 word, as fp32 (its bits moved up)."""
    return (((words >> shift) & 0xFFFF).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rounded(x, sx, NATIVE_FP8: tl.constexpr):
    """``x`` rounded to e4m3 values with its segment's scale ``sx`` (still to be multiplied back)."""
    return _e4m3_values(x, sx[:, None], NATIVE_FP8).to(tl.float8e4nv).to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, sw_ptr, y_ptr, partial_ptr, arrivals_ptr, N, K, stride_w, stride_sw, group_rows,
                     NUM_BLOCKS: tl.constexpr, CHUNKS_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                     W_ROW_TILE: tl.constexpr, BK: tl.constexpr, NATIVE_FP8: tl.constexpr, BN: tl.constexpr,
                     KB: tl.constexpr, AHEAD: tl.constexpr, ROUND_X: tl.constexpr):
    """``y``'s BN columns for one row on the CUDA cores. The weight is read as int32 words (``w_ptr``, ``stride_w``
    in words) and the bf16 activations as int64 words (``x_ptr``), four columns each: each weight row's KB bytes a
    step are one contiguous run, each weight word widened to four fp32 values that meet its four rounded
    activations times both scales: a program's BN rows lie in one ``W_ROW_TILE``-row scale tile, so each
    activation segment meets one weight scale. With ROUND_X the activations are rounded here, as ``act_quant``
    rounds them (bit for bit); without, they meet the weight unrounded (a weight the release dequantizes when it
    loads). Weight rows ``g * group_rows`` on read the g-th K-wide slice of ``x`` (a grouped projection; one group
    when ``group_rows >= N``). Each program reads the chunk of weights ``AHEAD`` (1 or 2) chunks on before it
    multiplies the current one. K splits and their sum work as ``split_k`` says. The first chunks of
    weights are read before the previous kernel's output is awaited (``dependent_launch``): no kernel writes
    weights."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    SEGMENTS: tl.constexpr = KB // BK
    WORDS: tl.constexpr = BK // 4
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    scale_row = sw_ptr + (pid_n * BN // W_ROW_TILE) * stride_sw  # the program's rows share their scales
    x_ptr += (pid_n * BN // group_rows).to(tl.int64) * (K // 4)  # and their group's slice of x
    segment = tl.arange(0, SEGMENTS)
    # [SEGMENTS, WORDS] word indices (word j holds columns 4j to 4j + 3)
    word = split * CHUNKS_PER_SPLIT * (KB // 4) + segment[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    words = K // 4
    rows = w_ptr + offs_n[:, None, None] * stride_w
    acc = tl.zeros((BN, SEGMENTS, WORDS), dtype=tl.float32)
    w = tl.load(rows + word[None, :, :], mask=n_ok[:, None, None] & (word < words)[None, :, :], other=0)
    if AHEAD == 2:
        w_ahead = tl.load(rows + (word + KB // 4)[None, :, :],
                          mask=n_ok[:, None, None] & ((word + KB // 4 < words) & (CHUNKS_PER_SPLIT > 1))[None, :, :],
                          other=0)
    wait_for_inputs()
    for chunk in range(CHUNKS_PER_SPLIT):
        far_word = word + AHEAD * (KB // 4)
        far_ok = (far_word < words) & (chunk + AHEAD < CHUNKS_PER_SPLIT)
        w_far = tl.load(rows + far_word[None, :, :], mask=n_ok[:, None, None] & far_ok[None, :, :], other=0)
        xw = tl.load(x_ptr + word, mask=word < words, other=0)  # four bf16 columns a word, like the weight's
        x0, x1, x2, x3 = _bf16_word(xw, 0), _bf16_word(xw, 16), _bf16_word(xw, 32), _bf16_word(xw, 48)
        block = (split * CHUNKS_PER_SPLIT + chunk) * SEGMENTS + segment
        scale = tl.load(scale_row + block, mask=block < NUM_BLOCKS, other=0.0)
        if ROUND_X:
            amax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
            sx = _segment_scale(tl.max(amax, axis=1))  # [SEGMENTS]
            scale = sx * scale
            x0, x1 = _e4m3_rounded(x0, sx, NATIVE_FP8), _e4m3_rounded(x1, sx, NATIVE_FP8)
            x2, x3 = _e4m3_rounded(x2, sx, NATIVE_FP8), _e4m3_rounded(x3, sx, NATIVE_FP8)
        w0, w1, w2, w3 = _word_bytes(w, NATIVE_FP8)
        acc += w0 * (x0 * scale[:, None])[None, :, :]
        acc += w1 * (x1 * scale[:, None])[None, :, :]
        acc += w2 * (x2 * scale[:, None])[None, :, :]
        acc += w3 * (x3 * scale[:, None])[None, :, :]
        if AHEAD == 2:
            w, w_ahead = w_ahead, w_far
        else:
            w = w_far
        word += KB // 4
    total = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]  # [BN, 1]
    store_split(total, y_ptr, partial_ptr, arrivals_ptr, pid_n, split, offs_n, tl.arange(0, 1), n_ok,
                tl.arange(0, 1) < 1, 1, N, N, SPLITS, True)


# One-row calls go to _fp8_gemv_kernel for bf16 activations and K in whole 4-byte words; BN rows lie in one weight
# scale tile (V4.1's are 32 rows), KB columns hold whole activation segments.
GEMV = True
GEMV_TILES = {"BN": 32, "KB": 256, "num_warps": 2, "num_stages": 1}
# Chunks of weights each program has in flight while it multiplies one: 2 holds another chunk's registers
GEMV_AHEAD = 2
# Programs a call wants per SM before K is split (measured on the H200 at V4.1-Flash's projections, one row: 3 gave
# 82.4 us a layer, 5 90.3, 10 91.5; the tensor-core kernel 95.6)
GEMV_PROGRAMS_PER_SM = 3


def gemv_tiles() -> dict:
    return GEMV_TILES if not INTERPRETED else {"BN": 16, "KB": 64}


def gemv_serves(flat: torch.Tensor, weight: torch.Tensor, weight_row_tile: int, block: int) -> bool:
    tiles = gemv_tiles()
    return (GEMV and flat.shape[0] == 1 and flat.dtype == torch.bfloat16 and flat.data_ptr() % 8 == 0
            and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight_row_tile % tiles["BN"] == 0
            and tiles["KB"] % block == 0 and block % 4 == 0)


def gemv(flat: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, weight_row_tile: int, block: int,
         y: torch.Tensor, groups: int = 1, round_x: bool = True) -> None:
    """``y`` [1, N] = the one bf16 row ``flat`` times the e4m3 ``weight`` [N, K] with its fp32 tile ``scales``: its
    activations rounded to e4m3 in 1 x ``block`` segments with ``round_x``, as they are without it. With ``groups``
    g, ``flat`` is [1, g K] and each N / g rows of the weight multiply their own K-wide slice of it."""
    k, n = weight.shape[1], weight.shape[0]
    meta = gemv_tiles()
    tiles, chunks = triton.cdiv(n, meta["BN"]), triton.cdiv(k, meta["KB"])
    splits = max(1, min(chunks, triton.cdiv(sm_count(flat.device) * GEMV_PROGRAMS_PER_SM, tiles)))
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    partials = torch.empty(splits, 1, n, dtype=torch.float32, device=flat.device) if splits > 1 else y
    _fp8_gemv_kernel[(tiles, splits)](
        flat.view(torch.int64), weight.view(torch.int32), scales, y, partials, arrival_counters(flat.device, tiles),
        n, k, weight.stride(0) // 4, scales.stride(0), n // groups, NUM_BLOCKS=triton.cdiv(k, block),
        CHUNKS_PER_SPLIT=per_split, SPLITS=splits, W_ROW_TILE=weight_row_tile, BK=block,
        NATIVE_FP8=_native_fp8(flat.device), AHEAD=GEMV_AHEAD, ROUND_X=round_x, **meta, **LAUNCH)
