"""MXFP4 experts through humming-kernels (``deepinfer_nvidia.moe_humming``): the routing tables in
``moe_align_block_size``'s format (on any device), and on an SM90 GPU with humming installed the route against the
torch reference MoE, eagerly and replayed in a CUDA graph with other routing, its in-place conversion, and the
layers it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.quantization import quantize_fp4  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia import moe_humming, moe_mxfp4_layout  # noqa: E402
from deepinfer_nvidia.moe import TritonMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _expected_tables(topk_ids: torch.Tensor, experts: int, block: int):
    """The tables as a loop over experts writes them: each expert's flat ids in order, padded to ``block``."""
    flat = topk_ids.flatten().tolist()
    sentinel = len(flat)
    ids, owners = [], []
    for expert in range(experts):
        mine = [i for i, e in enumerate(flat) if e == expert]
        blocks = -(-len(mine) // block)
        ids += mine + [sentinel] * (blocks * block - len(mine))
        owners += [expert] * blocks
    return ids, owners


@pytest.mark.parametrize("tokens, experts, top_k, block", [(1, 8, 2, 16), (5, 16, 4, 16), (40, 8, 3, 64),
                                                           (40, 8, 3, 48), (300, 12, 4, 32), (300, 12, 4, 96)])
def test_indexed_tables_match_a_loop_over_experts(tokens, experts, top_k, block):
    """Decode-sized calls (one launch) and a long prefill's (the sort: 1200 assignments) give the same tables, at
    block sizes that are not powers of two too (humming's heuristics pick 48 or 96 for some row counts); the blocks
    past the padded total are the grid's surplus, which the kernel never reads."""
    g = torch.Generator().manual_seed(tokens + experts)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 0] += 1 if tokens > 1 else 0  # a crowded expert; the last ones stay empty in the small cases
    topk_ids = scores.argsort(1, descending=True)[:, :top_k].to(DEVICE)
    sorted_ids, expert_ids, padded = moe_humming.indexed_tables(topk_ids, experts, block)
    ids, owners = _expected_tables(topk_ids.cpu(), experts, block)
    assert sorted_ids.dtype == expert_ids.dtype == padded.dtype == torch.int32 and padded.dim() == 0
    assert int(padded) == len(ids)
    assert sorted_ids[: len(ids)].tolist() == ids
    assert expert_ids[: len(owners)].tolist() == owners
    assert sorted_ids.numel() == expert_ids.numel() * block  # the surplus blocks are whole and padded
    assert (sorted_ids[len(ids):] == topk_ids.numel()).all()


def _packed(experts, rows, cols, g):
    codes, scales = zip(*(quantize_fp4((torch.randn(rows, cols, generator=g) * cols**-0.5).to(DEVICE))
                          for _ in range(experts)))
    return torch.stack(codes), torch.stack(scales)


def _weights(experts, hidden, inter, g):
    (w1, s1), (w3, s3) = _packed(experts, inter, hidden, g), _packed(experts, inter, hidden, g)
    w2, s2 = _packed(experts, hidden, inter, g)
    return ExpertWeights(w1, w3, w2, 7.0, s1, s3, s2, 32)


def test_layers_off_the_route_say_why():
    g = torch.Generator().manual_seed(3)
    if not CUDA:
        assert moe_humming.serves(_weights(2, 256, 256, g)) == "not packed MXFP4 on a GPU"
        return
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the width rule is checked on SM90")
    assert "multiples" in moe_humming.serves(_weights(2, 256, 192, g))
    assert moe_humming.serves(_weights(2, 512, 256, g)) is None


def _humming_or_skip():
    if not CUDA or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("humming's route runs on SM90 GPUs")
    module, why = moe_humming.load()
    if module is None:
        pytest.skip(why)


def _close(ours, reference):
    assert ours.shape == reference.shape and ours.dtype == reference.dtype and torch.isfinite(ours).all()
    # bf16 gate and up (as DeepGEMM's grouped route has them) move ~5% of SwiGLU's FP8 roundings by one e4m3 step,
    # ~2% of the output's norm; a wrong weight, scale or row gives 100%
    assert (ours.float() - reference.float()).norm() <= 0.03 * reference.float().norm()


@pytest.mark.parametrize("tokens", [1, 3, 64, 400])
def test_route_matches_the_reference(tokens):
    _humming_or_skip()
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 512, 256, 4
    weights = _weights(experts, hidden, inter, g)
    reference = TorchMoE()
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].to(DEVICE)
    topk_weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    expected = reference.routed_experts(x, ids, topk_weights, weights)
    codes_before = weights.w1.clone()
    moe = TritonMoE(reference=reference, humming=True)
    ours = moe.routed_experts(x, ids, topk_weights, weights)
    _close(ours, expected)
    assert getattr(weights.w1, moe_mxfp4_layout.LAYOUT_ATTRIBUTE) == moe_humming.HUMMING_LAYOUT
    assert not torch.equal(weights.w1, codes_before)  # converted in place, same bytes
    assert torch.equal(moe.routed_experts(x, ids, topk_weights, weights), ours)  # converted once, repeatable


def test_route_replays_in_a_cuda_graph_with_other_routing():
    _humming_or_skip()
    g = torch.Generator().manual_seed(7)
    experts, hidden, inter, top_k, tokens = 16, 512, 256, 4, 8
    weights = _weights(experts, hidden, inter, g)
    expected_for = {}
    inputs = []
    for _ in range(2):
        x = torch.randn(tokens, hidden, generator=g).to(DEVICE, torch.bfloat16)
        ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].to(DEVICE)
        inputs.append((x, ids, torch.rand(tokens, top_k, generator=g).to(DEVICE)))
        expected_for[len(inputs) - 1] = TorchMoE().routed_experts(*inputs[-1], weights)
    moe = TritonMoE(reference=TorchMoE(), humming=True)
    x, ids, topk_weights = (t.clone() for t in inputs[0])
    eager = moe.routed_experts(x, ids, topk_weights, weights)  # converts and compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(x, ids, topk_weights, weights)
    for index, (new_x, new_ids, new_weights) in enumerate(inputs):
        x.copy_(new_x), ids.copy_(new_ids), topk_weights.copy_(new_weights)
        graph.replay()
        _close(out, expected_for[index])
        if index == 0:
            assert torch.equal(out, eager)


def test_the_route_is_decided_per_layer_and_its_layout_mark_is_binding(monkeypatch, caplog):
    """On any device, with humming's calls stubbed: a layer humming refuses keeps Triton and the log says why; a
    layer it takes goes to it; once a layer's tensors carry humming's layout, every TritonMoE sends it there (no
    Triton kernel ever reads those bytes), and an unconverted layer never goes there without the route."""
    g = torch.Generator().manual_seed(5)
    weights = _weights(4, 64, 64, g)
    x = torch.randn(3, 64, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.rand(3, 4, generator=g).argsort(1)[:, :2].to(DEVICE)
    topk_weights = torch.rand(3, 2, generator=g).to(DEVICE)
    calls = []

    def stub(weights, *args):
        calls.append(weights)
        for codes in (weights.w1, weights.w3, weights.w2):
            setattr(codes, moe_mxfp4_layout.LAYOUT_ATTRIBUTE, moe_humming.HUMMING_LAYOUT)
        return torch.zeros_like(args[0])

    monkeypatch.setattr(moe_humming, "routed_experts", stub)
    monkeypatch.setattr(moe_humming, "serves", lambda w: "widths 64 and 64 are too narrow")
    expected = TorchMoE().routed_experts(x, ids, topk_weights, _copy(weights))
    with caplog.at_level("INFO"):
        ours = TritonMoE(reference=TorchMoE(), humming=True).routed_experts(x, ids, topk_weights, _copy(weights))
    assert not calls and "widths 64 and 64 are too narrow; Triton serves them" in caplog.text
    assert (ours.float() - expected.float()).norm() <= 1e-2 * expected.float().norm()

    monkeypatch.setattr(moe_humming, "serves", lambda w: None)
    assert not TritonMoE(reference=TorchMoE()).routed_experts(x, ids, topk_weights, weights).eq(0).all()
    assert not calls  # the route was not asked for
    fresh = _copy(weights)
    TritonMoE(reference=TorchMoE(), humming=True).routed_experts(x, ids, topk_weights, fresh)
    assert calls == [fresh]
    pinned = TritonMoE(reference=TorchMoE(), pinned=True)
    assert pinned.routed_experts(x, ids, topk_weights, fresh).eq(0).all() and calls == [fresh, fresh]


def _copy(weights):
    """Unmarked copies of a layer's tensors (each kernel's layout mark lives on the tensors)."""
    return ExpertWeights(*(t.clone() for t in (weights.w1, weights.w3, weights.w2)), weights.swiglu_limit,
                         *(t.clone() for t in (weights.w1_scale, weights.w3_scale, weights.w2_scale)),
                         weights.activation_block)


@pytest.mark.parametrize("rows, cols, dtype", [(1, 256, torch.bfloat16), (37, 2304, torch.bfloat16),
                                               (5, 96, torch.float32)])
def test_swiglu_rounded_in_one_pass_is_swiglu_then_the_rounding(rows, cols, dtype):
    """The down projection's input of the humming route and DeepGEMM's grouped one: SwiGLU's fp32 result rounded to
    FP8 in 1 x 32 blocks in one launch, bit for bit the two launches it replaces (fp32 SwiGLU, then the rounding),
    and the reference's rounding of the reference's SwiGLU up to the sigmoid's last bits."""
    from deepinfer.runtime.ops import swiglu
    from deepinfer.runtime.quantization import round_fp8
    from deepinfer_nvidia import activation
    from deepinfer_nvidia.fp8_rounding import fp8_rounded, swiglu_fp8_rounded

    g = torch.Generator().manual_seed(rows)
    gate, up = ((torch.randn(rows, cols, generator=g) * 4).to(DEVICE, dtype) for _ in range(2))
    fused = swiglu_fp8_rounded(gate, up, 7.0, 32)
    assert fused.dtype == torch.bfloat16 and fused.shape == (rows, cols)
    assert torch.equal(fused, fp8_rounded(activation.swiglu(gate.float(), up.float(), 7.0), 32))
    reference = round_fp8(swiglu(gate.float(), up.float(), 7.0), 32).to(torch.bfloat16)
    assert (fused.float() - reference.float()).norm() <= 1e-2 * reference.float().norm()
    with pytest.raises(ValueError, match="unit column strides"):
        swiglu_fp8_rounded(gate.t(), up.t(), 7.0, 32)
