"""Checkpoint weight formats: FP8 with power-of-two block scales and MXFP4, written and read back."""

from __future__ import annotations

import pytest
import torch

from deepinfer.runtime.quantization import (
    E2M1_VALUES, blockwise_linear, dequantize, infer_block, quantize_fp4, quantize_fp8, round_fp8, weight_block_size,
)


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
def test_fp8_roundtrip_within_e4m3_precision(block):
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize_fp8(w, *block)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (-(-96 // block[0]), -(-160 // block[1]))
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4, scales are exact powers of two
    back = dequantize(q, scale, torch.float32)
    assert torch.all((back - w).abs() <= w.abs() * 2**-4 + 1e-12)
    assert torch.equal(torch.log2(scale.float()), torch.log2(scale.float()).round())


def test_fp4_packs_even_column_in_low_nibble():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -6.0  # amax 6 -> scale 1
    packed, scale = quantize_fp4(w)
    assert scale.float().item() == 1.0
    byte = packed.view(torch.uint8)[0, 0].item()
    assert E2M1_VALUES[byte & 0xF] == 1.0 and E2M1_VALUES[byte >> 4] == -6.0
    assert torch.equal(dequantize(packed, scale, torch.float32), w)


def test_fp4_roundtrip_error_is_bounded_by_the_grid():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_fp4(w)
    back = dequantize(packed, scale, torch.float32)
    step = scale.float().repeat_interleave(32, 1)  # the widest e2m1 gap (4 -> 6) is 2 scale units
    assert torch.all((back - w).abs() <= step + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_is_every_code_times_its_own_scale(dtype):
    """Each stored value times the scale of its tile (expanded element by element here), bit for bit: every byte
    of packed MXFP4 (both zeros' signs), and FP8 with whole and partial edge tiles."""
    g = torch.Generator().manual_seed(2)
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).view(4, 64)
    scale = torch.randint(100, 150, (4, 4), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    lut = torch.tensor(E2M1_VALUES)
    codes = packed.view(torch.uint8).long()
    values = torch.stack((lut[codes & 0xF], lut[codes >> 4]), -1).view(4, 128)
    expected = (values * scale.float().repeat_interleave(32, 1)).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(dequantize(packed, scale, dtype).view(bits), expected.view(bits))
    for shape, block in (((256, 384), (128, 128)), ((200, 130), (128, 128)), ((64, 96), (1, 32))):
        q, s = quantize_fp8(torch.randn(*shape, generator=g), *block)
        tile = s.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]
        assert torch.equal(dequantize(q, s, dtype).view(bits), (q.float() * tile).to(dtype).view(bits))


def test_block_size_is_inferred_from_the_scale_shape():
    assert infer_block(4096, 32) == 128 and infer_block(4096, 128) == 32 and infer_block(64, 64) == 1
    with pytest.raises(ValueError, match="cannot tile"):
        infer_block(100, 3)


def test_scale_of_wrong_shape_is_an_error():
    packed, scale = quantize_fp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="needs a scale of shape"):
        dequantize(packed, scale[:, :1], torch.float32)


@pytest.mark.parametrize("fmt, activation_block", [("fp8-128", 128), ("fp8-32", 32), ("mxfp4", 128), ("mxfp4", 32)])
def test_blockwise_linear_is_the_dequantized_product_of_fp8_rounded_activations(fmt, activation_block):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 256, generator=g) * 0.05
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 1, 256)  # channels over four decades
    weight, scale = quantize_fp4(w) if fmt == "mxfp4" else quantize_fp8(w, *(2 * [int(fmt[4:])]))
    exact = dequantize(weight, scale, torch.float32)
    got = blockwise_linear(x, weight, scale, activation_block)
    # e4m3 rounds each activation by <= 2^-4 of itself, or by <= 2^-10 of its segment's power-of-two scale when
    # it is subnormal there; the weight is used exactly
    segment_scale = (x.abs().unflatten(1, (-1, activation_block)).amax(-1) / 448).log2().ceil().exp2()
    slack = 2**-4 * x.abs() + 2**-10 * segment_scale.repeat_interleave(activation_block, 1)
    bound = slack @ exact.abs().T + 1e-5 * (x.abs() @ exact.abs().T)
    error = (got - x @ exact.T).abs()
    assert torch.all(error <= bound)
    assert error.max() > 0  # the activations really were rounded
    assert torch.allclose(got, round_fp8(x, activation_block) @ exact.T, rtol=1e-5, atol=1e-6)


def test_blockwise_linear_dequantizes_in_slabs(monkeypatch):
    import deepinfer.runtime.quantization as quantization

    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    weight, scale = quantize_fp8(w, 32, 32)
    x = torch.randn(3, 64)
    whole = blockwise_linear(x, weight, scale, 32)
    monkeypatch.setattr(quantization, "_DEQUANT_CHUNK", 32 * 64)  # one block row per slab
    assert torch.allclose(blockwise_linear(x, weight, scale, 32), whole, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(quantization, "_DEQUANT_CHUNK", 100 * 64)  # rounded down to whole block rows
    assert torch.allclose(blockwise_linear(x, weight, scale, 32), whole, rtol=1e-6, atol=1e-6)


def test_weight_block_size_is_validated():
    assert weight_block_size(None, (32, 32)) == (32, 32)
    assert weight_block_size({"weight_block_size": [128, 128]}, (32, 32)) == (128, 128)
    for bad in ([128], [96, 96], "128", [0, 128]):
        with pytest.raises(ValueError, match="weight_block_size must be two powers of two"):
            weight_block_size({"weight_block_size": bad}, (32, 32))
