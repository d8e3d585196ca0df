"""The MXFP4 peers' one-time weight conversions (tools/gpu/mxfp4_peers.py) keep our values: dequantizing the
converted tensors with the peer's own layout and upcast code gives our ``dequantize_fp4``. Skips when the
peer's Python package is absent (triton_kernels lives in the ignored .peers/ folder)."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))

import mxfp4_peers  # noqa: E402
from deepinfer.runtime.quantization import dequantize_fp4, quantize_fp4  # noqa: E402


def _stack(experts, rows, cols):
    torch.manual_seed(0)
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols) * 3.0) for _ in range(experts)))
    return torch.stack(packed), torch.stack(scales)


def _ours(w, s):
    return torch.stack([dequantize_fp4(w[e], s[e], torch.float32) for e in range(w.shape[0])])


@pytest.mark.parametrize("hopper", [False, True])
def test_triton_kernels_conversion_round_trips(hopper):
    try:
        mxfp4_peers._import_triton_kernels()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"triton_kernels not importable: {exc}")
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch

    w1, s1 = _stack(2, 256, 512)
    w3, s3 = _stack(2, 256, 512)
    w13 = mxfp4_peers.interleave_rows(w1, w3)
    s13 = mxfp4_peers.interleave_rows(s1.view(torch.uint8), s3.view(torch.uint8))
    value, scale = mxfp4_peers.triton_kernels_weights(w13, s13, hopper)
    assert (type(value.storage.layout).__name__ == "HopperMXValueLayout") == hopper
    raw = value.storage.layout.unswizzle_data(value.storage.data)  # [E, K/2, 2N] bytes
    raw_scale = scale.storage.layout.unswizzle_data(scale.storage.data)  # [E, K/32, 2N]
    assert tuple(value.shape) == (2, 512, 512) and tuple(raw.shape) == (2, 256, 512)
    got = upcast_from_mxfp_torch(raw.contiguous(), raw_scale.contiguous(), torch.float32, axis=1)  # [E, K, 2N]
    expected = torch.stack((_ours(w1, s1), _ours(w3, s3)), dim=2).flatten(1, 2).transpose(-2, -1)
    assert torch.equal(got, expected)
    assert torch.equal(got[:, :, 0::2], _ours(w1, s1).transpose(-2, -1))  # even output columns = gate


def test_humming_schema_takes_our_layout():
    try:
        from humming.schema import Mxfp4WeightSchema
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"humming not importable: {exc}")
    attrs = Mxfp4WeightSchema().get_tensors_attrs(shape_n=256, shape_k=512, param_dtype=torch.bfloat16,
                                                  num_experts=2)
    w, s = _stack(2, 256, 512)
    assert tuple(attrs["weight"]["shape"]) == tuple(w.shape) and attrs["weight"]["dtype"] == torch.uint8
    assert tuple(attrs["weight_scale"]["shape"]) == tuple(s.shape)


def test_swiglu_matches_reference():
    from deepinfer.runtime.ops import swiglu

    gate, up = torch.randn(8, 64) * 8, torch.randn(8, 64) * 8
    assert torch.allclose(mxfp4_peers.swiglu_fp32(gate, up, 7.0), swiglu(gate, up, 7.0).float())
