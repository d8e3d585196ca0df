"""The swap-AB MXFP4 experts (``deepinfer_nvidia.moe_mxfp4``): the repacked layout round-trips exactly, its
dequantizer equals the reference's, layers it cannot take keep the byte-layout kernel, and the kernel matches the
torch reference MoE, eagerly and replayed in a CUDA graph (natively on a GPU, in Triton's interpreter elsewhere).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.quantization import dequantize_fp4, quantize_fp4  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia import moe_mxfp4, moe_mxfp4_layout  # noqa: E402
from deepinfer_nvidia.moe import TritonMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _packed(experts: int, rows: int, cols: int, g: torch.Generator, spread: float = 1.0):
    codes, scales = zip(*(quantize_fp4((torch.randn(rows, cols, generator=g) * cols**-0.5 * spread).to(DEVICE))
                          for _ in range(experts)))
    return torch.stack(codes), torch.stack(scales)


def test_repack_round_trips_exactly_within_each_16_row_block():
    g = torch.Generator().manual_seed(0)
    codes, _ = _packed(3, 32, 192, g)
    codes[0, 0] = torch.randint(-128, 128, (96,), generator=g, dtype=torch.int8).to(DEVICE)  # every bit pattern
    repacked = codes.clone()
    moe_mxfp4_layout.repack(repacked)
    assert not torch.equal(repacked, codes)
    assert torch.equal(moe_mxfp4_layout.unpack(repacked), codes)
    alone = codes[:, 16:].clone()  # a block's codes decide its repacked bytes alone
    moe_mxfp4_layout.repack(alone)
    assert torch.equal(alone, repacked[:, 16:])


def test_dequantized_repacked_experts_equal_the_reference():
    g = torch.Generator().manual_seed(1)
    codes, scales = _packed(2, 48, 128, g)
    expected = torch.stack([dequantize_fp4(c, s, torch.bfloat16) for c, s in zip(codes, scales)])
    moe_mxfp4_layout.repack(codes)
    assert torch.equal(moe_mxfp4.dequantize(codes, scales), expected)


def _weights(experts: int, hidden: int, inter: int, g: torch.Generator, spread: float = 1.0) -> ExpertWeights:
    (w1, s1), (w3, s3) = _packed(experts, inter, hidden, g, spread), _packed(experts, inter, hidden, g, spread)
    w2, s2 = _packed(experts, hidden, inter, g, spread)
    return ExpertWeights(w1, w3, w2, 7.0, s1, s3, s2, 32)


def _routing(tokens: int, experts: int, top_k: int, hidden: int, g: torch.Generator):
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
    ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].to(DEVICE)
    return x, ids, torch.rand(tokens, top_k, generator=g).to(DEVICE)


def _close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    # The same exact products in another fp32 summation order, then each side's bf16 rounding of the output (one ulp
    # apart where they straddle a rounding boundary: 2^-8 relative). Where a SwiGLU output sits on an FP8 rounding
    # boundary the order can also flip it by one e4m3 step before w2. A mis-decoded layout errs by 30% and more.
    ours, reference = ours.float(), reference.float()
    assert torch.isfinite(ours).all()
    assert float((ours - reference).norm() / reference.norm()) <= 1e-2
    assert float((ours - reference).abs().max()) <= 2**-5 * float(reference.abs().max())


# (tokens, experts, top-k, hidden, intermediate): a decode step, uneven experts, a prefill-sized block
SHAPES = [(1, 8, 2, 128, 64), (21, 6, 3, 192, 64), (70, 4, 2, 64, 128)]
if CUDA:
    SHAPES += [(1, 384, 6, 5120, 2304), (300, 32, 6, 1024, 512)]  # tools/gpu/gpu_mxfp4.py checks V4.1 at 8-2048


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", SHAPES)
def test_swap_ab_experts_match_the_reference(tokens, experts, top_k, hidden, inter):
    g = torch.Generator().manual_seed(tokens + experts)
    weights = _weights(experts, hidden, inter, g)
    x, ids, topk_weights = _routing(tokens, experts, top_k, hidden, g)
    reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)  # first: the backend repacks in place
    ours = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    assert moe_mxfp4_layout.is_repacked(weights.w1) and moe_mxfp4_layout.is_repacked(weights.w2)
    _close(ours, reference)


def test_k_is_split_only_where_a_launch_would_leave_sms_idle():
    # an H200 (132 SMs) at batch 1: 6 experts x 36 column tiles for w1/w3 (80 chunks of K), x 80 for w2 (36)
    assert moe_mxfp4.splits(6 * 36, 80, 132) == 2 and moe_mxfp4.splits(6 * 80, 36, 132) == 2
    assert moe_mxfp4.splits(83 * 36, 80, 132) == 1  # 16 tokens
    assert moe_mxfp4.splits(1, 7, 132) == 7 and moe_mxfp4.splits(1, 80, 1) == 4  # divisors only


@pytest.mark.parametrize("programs_per_sm", [1, 1024])
def test_split_k_partial_sums_match_the_reference(monkeypatch, programs_per_sm):
    g = torch.Generator().manual_seed(6)
    weights = _weights(8, 256, 128, g)
    x, ids, topk_weights = _routing(2, 8, 2, 256, g)
    reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)
    # one SM, as the interpreter counts, on a GPU too. 1 program per SM: no split (8 and 16 busy programs); 1024:
    # w1/w3's 4 chunks in 4 parts, w2's 2 in 2
    monkeypatch.setattr(moe_mxfp4, "_sms", lambda device: 1)
    monkeypatch.setattr(moe_mxfp4, "PROGRAMS_PER_SM", programs_per_sm)
    launched = []
    original = moe_mxfp4.splits
    monkeypatch.setattr(moe_mxfp4, "splits", lambda *args: launched.append(original(*args)) or launched[-1])
    _close(TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights), reference)
    assert launched == ([1, 1] if programs_per_sm == 1 else [4, 2])


def test_scales_past_the_folded_range_keep_the_byte_layout():
    g = torch.Generator().manual_seed(3)
    weights = _weights(4, 64, 64, g, spread=2.0**12)  # scales of 2^6 and more: 2^(e - 1) leaves bf16's range
    assert "scale above" in moe_mxfp4_layout.repackable(weights.w1, weights.w1_scale)
    x, ids, topk_weights = _routing(5, 4, 2, 64, g)
    reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)
    ours = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    assert not moe_mxfp4_layout.is_repacked(weights.w1)
    _close(ours, reference)


def test_a_half_repacked_layer_is_refused():
    g = torch.Generator().manual_seed(4)
    weights = _weights(2, 64, 64, g)
    moe_mxfp4_layout.repack(weights.w1)
    setattr(weights.w1, moe_mxfp4_layout.LAYOUT_ATTRIBUTE, "swap-ab")
    with pytest.raises(ValueError, match="some of a layer's"):
        moe_mxfp4_layout.prepare(weights)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_replayed_in_a_cuda_graph_with_new_routing():
    g = torch.Generator().manual_seed(5)
    weights = _weights(64, 1024, 512, g)
    backend = TritonMoE(TorchMoE())
    x, ids, topk_weights = _routing(8, 64, 6, 1024, g)
    references = []
    for _ in range(3):
        new_x, new_ids, new_w = _routing(8, 64, 6, 1024, g)
        references.append((new_x, new_ids, new_w, TorchMoE().routed_experts(new_x, new_ids, new_w, weights)))
    backend.routed_experts(x, ids, topk_weights, weights)  # eager: repacks, compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.routed_experts(x, ids, topk_weights, weights)
    for new_x, new_ids, new_w, reference in references:
        x.copy_(new_x), ids.copy_(new_ids), topk_weights.copy_(new_w)
        graph.replay()
        _close(out, reference)
