"""The NVIDIA backend's Triton FP8 GEMM against the torch reference (``blockwise_linear``).

On a GPU the kernels run natively at real shapes; elsewhere Triton's interpreter runs them at tiny shapes (its
fp32 -> e4m3 conversion is wrong, so the kernel rounds in fp32 arithmetic there, and both paths are checked bit for
bit against ``round_fp8``). Skipped when triton is not installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py turns Triton's interpreter on without a GPU"
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.engine.config import EngineConfig  # noqa: E402
from deepinfer.runtime.quantization import blockwise_linear, dequantize, infer_block, quantize_fp8, round_fp8  # noqa: E402
from deepinfer_nvidia import plugin  # noqa: E402
from deepinfer_nvidia.fp8_rounding import act_quant, fp8_rounded  # noqa: E402
from deepinfer_nvidia.fp8_linear import FEW_ROWS, TritonLinear, _programs_wanted, split_count  # noqa: E402
from deepinfer_nvidia.split_k import counters_are_zero  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (tokens, out, in, block): V4's 128 tiles and V4.1's 32 tiles, ragged edges, decode and prefill sizes (the
# second line's are split over K: a few rows and a long K, as in decode; the last has more rows than the few-row
# kernel takes)
SHAPES = [(1, 64, 96, 32), (5, 70, 96, 32), (3, 130, 256, 128),
          (2, 64, 512, 32), (1, 40, 416, 32), (20, 72, 1024, 32), (FEW_ROWS + 3, 40, 96, 32)]
if CUDA:
    SHAPES += [(1, 4096, 4096, 128), (64, 1024, 4096, 128), (300, 2048, 7168, 128), (16, 5120, 1024, 32),
               (1000, 3072, 5120, 32), (1, 1536, 5120, 32), (4, 7168, 2048, 128), (9, 32768, 1280, 32),
               (40, 5120, 8192, 32), (1, 512, 5120, 32)]


def _poison() -> None:
    """Leave NaNs where the caching allocator will hand out the kernels' next buffers."""
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)


def _inputs(tokens: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # channels over seven decades: e4m3 normals, subnormals inside a segment, and ties
    x = torch.randn(tokens, cols, generator=g) * torch.logspace(-6, 1, cols)
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("tokens, out, cols, block", SHAPES)
def test_act_quant_is_bit_exact(tokens, out, cols, block):
    x = _inputs(tokens, cols, seed=tokens + cols)
    _poison()
    q, scales = act_quant(x, block)
    ours = q.float() * scales.repeat_interleave(block, 1)[:, :cols]
    assert torch.equal(ours, round_fp8(x, block))


@pytest.mark.parametrize("tokens, cols, block", [(7, 100, 32), (9, 4160, 128), (70, 160, 32)])
def test_act_quant_tiles_cover_partial_segments_and_rows(tokens, cols, block):
    """A last segment shorter than the block, segment groups past the row's end, several rows per program with a
    partial last tile."""
    x = _inputs(tokens, cols, seed=cols)
    _poison()
    q, scales = act_quant(x, block)
    assert torch.equal(q.float() * scales.repeat_interleave(block, 1)[:, :cols], round_fp8(x, block))
    # the same values as bf16 in one pass (exact: e4m3 values times powers of two), for bf16 GEMMs
    assert torch.equal(fp8_rounded(x, block), round_fp8(x, block).to(torch.bfloat16))


@pytest.mark.parametrize("tokens, cols, block", [(1, 64, 32), (7, 96, 32), (70, 4160, 128)])
def test_act_quant_with_pairs_apart_holds_each_32_columns_even_then_odd(tokens, cols, block):
    """The MXFP4 experts' activations: act_quant's values (fp16, exact) with each 32 columns' even ones first."""
    x = _inputs(tokens, cols, seed=cols + 1)
    _poison()
    q, scales = act_quant(x, block, pairs_apart=True)
    expected_q, expected_scales = act_quant(x, block)
    pairs = expected_q.float().view(tokens, cols // 32, 16, 2)
    assert q.dtype == torch.float16 and torch.equal(scales, expected_scales)
    assert torch.equal(q.float(), torch.cat([pairs[..., 0], pairs[..., 1]], -1).view(tokens, cols))
    with pytest.raises(ValueError, match="32-column"):
        act_quant(x[:, :48], 16, pairs_apart=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, out, cols, block", SHAPES)
def test_fp8_linear_matches_the_reference(tokens, out, cols, block, dtype):
    g = torch.Generator().manual_seed(out)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, cols, seed=out + cols, dtype=dtype)
    _poison()
    ours = TritonLinear().linear(x, weight, scale, block)
    reference = blockwise_linear(x.float(), weight, scale, block)
    assert ours.dtype == dtype and ours.shape == (tokens, out)
    # The same products summed in another order, then rounded to the output dtype (one bf16 ulp: the interpreter
    # truncates where the GPU rounds to nearest). Hopper's fp8 MMAs keep only about 14 bits while they accumulate
    # one tile (DeepSeek-V3 report, 3.3.2), which the kernel promotes to fp32 every BK: 2^-9 of sum |x||w| covers it.
    magnitude = round_fp8(x.float(), block).abs() @ dequantize(weight, scale, torch.float32).abs().T
    tolerance = magnitude * (2**-9 if CUDA else 1e-5) + (reference.abs() * 2**-7 if dtype == torch.bfloat16 else 0)
    assert torch.all((ours.float() - reference).abs() <= tolerance)


MANY_ROWS = [(FEW_ROWS + 3, 40, 96, 32), (FEW_ROWS + 1, 64, 160, 32)] + (
    [(192, 5120, 8192, 32), (2048, 32768, 1280, 32), (300, 2048, 7168, 128)] if CUDA else [])


@pytest.mark.parametrize("through_cublas", [True, False])
@pytest.mark.parametrize("tokens, out, cols, block", MANY_ROWS)
def test_many_row_calls_match_the_reference_on_either_route(tokens, out, cols, block, through_cublas, monkeypatch):
    """Past FEW_ROWS bf16 rows: cuBLAS's bf16 GEMM on the expanded weight (fp8_bf16_gemm), or the Triton FP8 GEMM;
    both within the FP8 path's bound of the reference."""
    from deepinfer_nvidia import fp8_linear

    monkeypatch.setattr(fp8_linear, "BF16_GEMM_MIN_ROWS", FEW_ROWS + 1 if through_cublas else 1 << 62)
    g = torch.Generator().manual_seed(tokens)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, cols, seed=tokens + cols, dtype=torch.bfloat16)
    _poison()
    ours = TritonLinear().linear(x, weight, scale, block).float()
    reference = blockwise_linear(x.float(), weight, scale, block)
    magnitude = round_fp8(x.float(), block).abs() @ dequantize(weight, scale, torch.float32).abs().T
    assert torch.all((ours - reference).abs() <= magnitude * (2**-9 if CUDA else 1e-5) + reference.abs() * 2**-7)


@pytest.mark.parametrize("out, cols, block", [(40, 96, 32), (130, 256, 128), (72, 1000, 32)])
def test_the_expanded_weight_is_the_dequantized_one_exactly(out, cols, block):
    from deepinfer_nvidia.fp8_bf16_gemm import expanded_weight
    from deepinfer_nvidia.fp8_linear import _fp32_scales

    g = torch.Generator().manual_seed(out)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * 10.0 ** torch.randint(-6, 3, (out, 1),
                                                                                           generator=g), block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    _poison()
    got = expanded_weight(weight, _fp32_scales(scale), block, block)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), dequantize(weight, scale, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_calls_match_rounding_first_and_summing_apart_bit_for_bit(dtype, monkeypatch):
    """A call of a few rows is one launch (the GEMM rounds its activations, its last split sums the partials): the
    same result, bit for bit, as ``act_quant``'s launch, the same GEMM and ``_sum_splits_kernel``'s launch."""
    from deepinfer_nvidia import fp8_linear

    g = torch.Generator().manual_seed(7)
    tokens, out, cols, block = (3, 1536, 5120, 32) if CUDA else (3, 64, 512, 32)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, cols, seed=3, dtype=dtype)
    assert split_count(out, cols // block, _programs_wanted(DEVICE)) > 1
    one_launch = TritonLinear().linear(x, weight, scale, block)
    monkeypatch.setattr(fp8_linear, "ONE_LAUNCH_MAX_ROWS", 0)
    assert torch.equal(one_launch, TritonLinear().linear(x, weight, scale, block))


@pytest.mark.skipif(not CUDA, reason="a race between programs shows only on a GPU")
@pytest.mark.parametrize("tokens, out, cols, block", [(16, 5120, 1024, 32), (64, 1024, 4096, 128), (64, 1536, 5120, 32)])
def test_one_launch_sums_repeat_bit_for_bit(tokens, out, cols, block, monkeypatch):
    """The last split reads the others' partials after their arrivals: twenty repeats of the one-launch path equal
    the two-launch result bit for bit, up to 64 rows (more than it serves: one 64-row run of it failed
    ``test_fp8_linear_matches_the_reference`` once on the H200, not reproduced since)."""
    from deepinfer_nvidia import fp8_linear

    g = torch.Generator().manual_seed(out)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, cols, seed=out + 1)
    monkeypatch.setattr(fp8_linear, "ONE_LAUNCH_MAX_ROWS", 0)
    two_launches = TritonLinear().linear(x, weight, scale, block)
    monkeypatch.setattr(fp8_linear, "ONE_LAUNCH_MAX_ROWS", 64)
    for _ in range(20):
        _poison()
        assert torch.equal(TritonLinear().linear(x, weight, scale, block), two_launches)


# (out, in, block) of one-row calls: V4.1's projections as the engine calls them, V4's 128 tiles, ragged edges
GEMV_SHAPES = [(64, 96, 32), (70, 416, 32), (40, 1024, 32)]
if CUDA:
    GEMV_SHAPES += [(1792, 5120, 32), (32768, 1280, 32), (5120, 8192, 32), (4608, 5120, 32), (5120, 2304, 32),
                    (4096, 1280, 32), (4096, 7168, 128), (100, 4100, 32)]


@pytest.mark.parametrize("out, cols, block", GEMV_SHAPES)
def test_one_row_gemv_reads_ahead_without_changing_a_bit(out, cols, block, monkeypatch):
    """Two chunks of weights in flight (``GEMV_AHEAD``) multiply and add in the same order as one."""
    from deepinfer_nvidia import fp8_gemv

    g = torch.Generator().manual_seed(out * cols)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(1, cols, seed=cols, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8_gemv, "GEMV", True)
    results = []
    for ahead in (1, 2):
        monkeypatch.setattr(fp8_gemv, "GEMV_AHEAD", ahead)
        results.append(TritonLinear().linear(x, weight, scale, block))
    assert torch.equal(results[0], results[1])
    assert results[0].abs().max() > 0


@pytest.mark.parametrize("out, cols, block", GEMV_SHAPES)
def test_one_row_gemv_matches_the_reference_and_the_tensor_core_path(out, cols, block, monkeypatch):
    """A one-row bf16 call goes to the CUDA-core GEMV: within the reference's bound (its products in fp32, summed
    in another order), on weights with e4m3 subnormals too, and close to the tensor-core kernel's result."""
    from deepinfer_nvidia import fp8_gemv

    g = torch.Generator().manual_seed(out + cols)
    dense = torch.randn(out, cols, generator=g) * cols**-0.5
    dense[:, ::7] *= 1e-4  # under e4m3's smallest normal in their tiles
    weight, scale = quantize_fp8(dense, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(1, cols, seed=out, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8_gemv, "GEMV", True)
    assert fp8_gemv.gemv_serves(x, weight, infer_block(out, scale.shape[0]), block)
    _poison()
    ours = TritonLinear().linear(x, weight, scale, block)
    reference = blockwise_linear(x.float(), weight, scale, block)
    magnitude = round_fp8(x.float(), block).abs() @ dequantize(weight, scale, torch.float32).abs().T
    assert torch.all((ours.float() - reference).abs() <= magnitude * 1e-5 + reference.abs() * 2**-7)
    assert counters_are_zero(x.device)
    assert torch.equal(ours, TritonLinear().linear(x, weight, scale, block))  # repeats bit for bit
    monkeypatch.setattr(fp8_gemv, "GEMV", False)
    tensor_cores = TritonLinear().linear(x, weight, scale, block)
    assert torch.all((ours.float() - tensor_cores.float()).abs() <= magnitude * 2**-9 + reference.abs() * 2**-7)


def test_the_gemv_takes_only_what_it_reads_as_words(monkeypatch):
    """Several rows, fp32 activations, a K that is not whole words or activations not 8-byte aligned go to the
    tensor-core kernel (and still match the reference)."""
    from deepinfer_nvidia import fp8_gemv

    monkeypatch.setattr(fp8_gemv, "GEMV", True)
    weight, scale = quantize_fp8(torch.randn(64, 96), 32, 32)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(1, 96, seed=1, dtype=torch.bfloat16)
    assert fp8_gemv.gemv_serves(x, weight, 32, 32)
    assert not fp8_gemv.gemv_serves(x.repeat(2, 1), weight, 32, 32)
    assert not fp8_gemv.gemv_serves(x.float(), weight, 32, 32)
    assert not fp8_gemv.gemv_serves(x, weight[:, :94], 32, 32)
    unaligned = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(1, 96)
    assert unaligned.data_ptr() % 8 and not fp8_gemv.gemv_serves(unaligned, weight, 32, 32)
    reference = blockwise_linear(x.float(), weight, scale, 32)
    assert torch.allclose(TritonLinear().linear(unaligned, weight, scale, 32).float(), reference, rtol=2**-7, atol=1e-6)


def test_split_calls_leave_their_arrival_counters_zero_and_repeat_bit_for_bit():
    """The last split of each column tile sums the partials and zeroes its counter: a second call (a graph replay
    reuses the counters the same way) gives the same bits, and a call with more column tiles finds zeros too."""
    g = torch.Generator().manual_seed(11)
    block = 32
    for out, cols in ((64, 512), (160, 1024)):
        weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
        weight, scale = weight.to(DEVICE), scale.to(DEVICE)
        x = _inputs(2, cols, seed=cols, dtype=torch.bfloat16)
        assert split_count(out, cols // block, _programs_wanted(DEVICE)) > 1
        first = TritonLinear().linear(x, weight, scale, block)
        assert counters_are_zero(x.device)
        assert torch.equal(first, TritonLinear().linear(x, weight, scale, block))


def test_decode_sized_calls_split_k_and_others_do_not():
    programs = _programs_wanted(DEVICE)
    if not CUDA:  # the interpreter's 32-column tiles and 8 programs
        assert split_count(64, 16, programs) == 4 and split_count(40, 13, programs) == 3  # 5 + 5 + 3 blocks
    else:
        assert split_count(1536, 160, programs) > 4
        assert split_count(65536, 40, programs) == 1  # enough column tiles already
    assert split_count(64, 3, programs) == 1  # too short a K to split
    for n, blocks in ((40, 13), (64, 17), (8, 160)):  # no split is left without a K tile
        splits = split_count(n, blocks, programs)
        assert (splits - 1) * -(-blocks // splits) < blocks


def test_plugin_answers_only_on_cuda():
    from deepinfer_nvidia.moe import TritonMoE

    for hook in (plugin.deepinfer_linear_backend, plugin.deepinfer_moe_backend):
        assert hook(config=None, device=torch.device("cpu")) is None
    if CUDA:
        assert isinstance(plugin.deepinfer_linear_backend(config=EngineConfig(), device=DEVICE), TritonLinear)
        assert isinstance(plugin.deepinfer_moe_backend(config=EngineConfig(), device=DEVICE), TritonMoE)


def test_deep_gemm_is_asked_only_for_its_recipe():
    """bf16 activations, 1 x 128 activation blocks and 128 x 128 weight tiles (V4's FP8 checkpoints)."""
    from deepinfer_nvidia.fp8_linear import deep_gemm_serves

    weight = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    x = torch.zeros(3, 512, dtype=torch.bfloat16)
    assert deep_gemm_serves(x, weight, torch.zeros(2, 4), 128)
    assert not deep_gemm_serves(x.float(), weight, torch.zeros(2, 4), 128)  # fp32 activations
    assert not deep_gemm_serves(x, weight, torch.zeros(8, 16), 32)  # V4.1's 32 x 32 tiles


@pytest.mark.skipif(not CUDA, reason="DeepGEMM needs a GPU")
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_deep_gemm_matches_the_triton_gemm(tokens):
    from deepinfer_nvidia.deepseek_kernels import deep_gemm

    module, route = deep_gemm()
    if module is None:
        pytest.skip(f"DeepGEMM not provisioned: {route}")
    g = torch.Generator().manual_seed(tokens)
    weight, scale = quantize_fp8(torch.randn(1024, 2048, generator=g) * 2048**-0.5, 128, 128)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, 2048, seed=tokens, dtype=torch.bfloat16)
    theirs = TritonLinear(deep_gemm=module).linear(x, weight, scale, 128)
    ours = TritonLinear().linear(x, weight, scale, 128)
    magnitude = round_fp8(x.float(), 128).abs() @ dequantize(weight, scale, torch.float32).abs().T
    assert torch.all((theirs.float() - ours.float()).abs() <= magnitude * 2**-8 + ours.float().abs() * 2**-7)


@pytest.mark.skipif(not CUDA, reason="kernel builds are counted on a GPU (the interpreter builds nothing)")
def test_row_counts_of_one_tile_size_share_one_build():
    """A served step's token count is whatever its requests add up to: counts with the same tiles (few rows: 17-32,
    the autotuned GEMM: 65-191, odd or multiples of 16 alike) must reuse the binaries the first one built, or a
    request waits through a build (deepinfer serve's warm-up cannot meet every count)."""
    from deepinfer.runtime import kernel_compiles

    kernel_compiles.start_counting()
    g = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8(torch.randn(256, 512, generator=g) * 512**-0.5, 32, 32)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    linear = TritonLinear()
    for counts in ((17, 32, 23, 31), (80, 95, 128, 150)):
        linear.linear(_inputs(counts[0], 512, seed=1, dtype=torch.bfloat16), weight, scale, 32)
        built = kernel_compiles.count()
        for tokens in counts[1:]:
            ours = linear.linear(_inputs(tokens, 512, seed=tokens, dtype=torch.bfloat16), weight, scale, 32)
            assert ours.shape == (tokens, 256)
        assert kernel_compiles.count() == built, counts


# (tokens, groups, rows a group, columns, block): V4.1-Flash's wo_a is 8 groups of 1024 rows over 4096 columns in
# 32 x 32 tiles (V4's: 128 x 128). One row goes to the GEMV, up to FEW_ROWS to the few-rows kernel on bf16 tensor
# cores (one launch to 16 rows, then a second summing the splits), more to cuBLAS on the expanded weight
GROUPED_SHAPES = [(1, 2, 32, 96, 32), (1, 4, 64, 128, 32), (3, 2, 32, 96, 32), (FEW_ROWS + 1, 2, 32, 64, 32)]
if CUDA:
    GROUPED_SHAPES += [(1, 8, 1024, 4096, 32), (1, 8, 1024, 4096, 128), (1, 3, 96, 4100, 32), (6, 8, 1024, 4096, 32),
                       (6, 8, 1024, 4096, 128), (40, 8, 1024, 4096, 32), (FEW_ROWS, 8, 1024, 4096, 32),
                       (200, 8, 1024, 4096, 32)]


@pytest.mark.parametrize("tokens, groups, rows, cols, block", GROUPED_SHAPES)
@pytest.mark.parametrize("few_rows", [False, True])
def test_grouped_projection_matches_the_dequantized_weight(tokens, groups, rows, cols, block, few_rows, monkeypatch):
    """An FP8 ``wo_a``: each group's slice of the row times its rows of the weight, the activations unrounded (FP8
    rounding would be off by up to 2^-4), as the release's dequantized copy multiplies them: within fp32 summation
    order and one step of the bf16 output (the interpreter truncates), repeatable bit for bit."""
    from deepinfer_nvidia import fp8_gemv, fp8_linear

    monkeypatch.setattr(fp8_linear, "GROUPED_FEW_ROWS", few_rows)  # 2 to FEW_ROWS rows: the kernel or the expansion
    g = torch.Generator().manual_seed(groups * rows + cols)
    dense = torch.randn(groups * rows, cols, generator=g) * cols**-0.5
    dense[:, ::7] *= 1e-4  # under e4m3's smallest normal in their tiles
    weight, scale = quantize_fp8(dense, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(tokens, groups * cols, seed=cols, dtype=torch.bfloat16).view(tokens, groups, cols)
    assert fp8_gemv.gemv_serves(x.reshape(tokens, -1), weight, infer_block(groups * rows, scale.shape[0]),
                                block) == (tokens == 1)
    _poison()
    ours = TritonLinear().grouped_linear(x, weight, scale)
    assert ours.shape == (tokens, groups, rows) and ours.dtype == torch.bfloat16
    dequantized = dequantize(weight, scale, torch.float32).view(groups, rows, cols)
    exact = torch.einsum("tgc,grc->tgr", x.float(), dequantized)
    magnitude = torch.einsum("tgc,grc->tgr", x.float().abs(), dequantized.abs())
    assert torch.all((ours.float() - exact).abs() <= magnitude * 1e-5 + exact.abs() * 2**-7)
    assert torch.equal(ours, TritonLinear().grouped_linear(x, weight, scale))
    assert counters_are_zero(x.device)


def test_grouped_projection_in_batch_invariant_mode_expands_the_weight_at_every_row_count():
    """Pinned tiles (batch-invariant mode): one row and many give the einsum on the expanded weight, the products
    the batch-invariant plugin tiles, so a token's output does not depend on its batch."""
    weight, scale = quantize_fp8(torch.randn(2 * 32, 96), 32, 32)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = _inputs(3, 2 * 96, seed=5, dtype=torch.bfloat16).view(3, 2, 96)
    pinned = TritonLinear(pinned=True)
    dense = dequantize(weight, scale, torch.bfloat16).view(2, 32, 96)
    assert torch.equal(pinned.grouped_linear(x, weight, scale), torch.einsum("tgc,grc->tgr", x, dense))
    assert torch.equal(pinned.grouped_linear(x[:1], weight, scale), torch.einsum("tgc,grc->tgr", x[:1], dense))


def test_grouped_projection_reference_is_the_dequantized_einsum():
    """The torch backend's ``grouped_linear`` is what the model computed before ``wo_a`` stayed in FP8: the weight
    dequantized to the activations' dtype, then one einsum (so CPU outputs did not move)."""
    from deepinfer.plugins.builtin.torch_linear import TorchLinear

    weight, scale = quantize_fp8(torch.randn(4 * 32, 64), 32, 32)
    x = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    expected = torch.einsum("tgd,grd->tgr", x, dequantize(weight, scale, torch.bfloat16).view(4, 32, 64))
    assert torch.equal(TorchLinear().grouped_linear(x, weight, scale), expected)
