"""Checkpoint weight formats: FP8 with power-of-two block scales and MXFP4, written and read back."""

from __future__ import annotations

import pytest
import torch

from deepinfer.core.quantization import E2M1_VALUES, dequantize, infer_block, quantize_fp4, quantize_fp8


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


def test_block_size_is_inferred_from_the_scale_shape():
    assert infer_block(4096, 32) == 128 and infer_block(4096, 128) == 32 and infer_block(64, 64) == 1
    with pytest.raises(ValueError, match="cannot tile"):
        infer_block(100, 3)


def test_scale_of_wrong_shape_is_an_error():
    packed, scale = quantize_fp4(torch.randn(8, 64))
    with pytest.raises(ValueError, match="needs a scale of shape"):
        dequantize(packed, scale[:, :1], torch.float32)
