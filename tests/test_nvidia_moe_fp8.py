"""FP8 routed experts (``deepinfer_nvidia.moe_fp8``: V4-Flash-Base's format) against the torch reference MoE: the
Triton grouped kernel, and DeepGEMM's masked grouped GEMM at decode.

On a CPU (Triton's interpreter) a torch stand-in plays DeepGEMM's masked GEMM, keeping its contract's edges: each
expert's rows past its count get NaN. On a GPU where build.sh provisioned DeepGEMM, its own kernel runs, in a
CUDA graph too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.quantization import dequantize_fp8, quantize_fp8  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia import moe as moe_module  # noqa: E402
from deepinfer_nvidia import moe_fp8  # noqa: E402
from deepinfer_nvidia.deepseek_kernels import masked_fp8_gemm  # noqa: E402
from deepinfer_nvidia.moe import LARGE_BM, TritonMoE, block_rows  # noqa: E402
from test_nvidia_moe import _inputs  # noqa: E402  (the same routing and activations as the other formats')

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ALIGN = 16  # the stand-in's slab alignment (DeepGEMM's own is 128 on SM90)
DEEPGEMM = CUDA and masked_fp8_gemm()[0] is not None


class MaskedStandIn:
    """``m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)`` in torch, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, lhs, rhs, d, masked_m, expected_m):
        (a, sfa), (b, sfb) = lhs, rhs
        assert a.dtype == b.dtype == torch.float8_e4m3fn and sfa.dtype == sfb.dtype == torch.float32
        assert d.dtype == torch.bfloat16 and masked_m.dtype == torch.int32 and expected_m >= 1
        assert a.shape[1] % ALIGN == 0 and a.shape[:2] == d.shape[:2] and b.shape[0] == a.shape[0]
        self.calls += 1
        d.fill_(float("nan"))  # rows past an expert's count: nobody may read them
        for expert, rows in enumerate(masked_m.tolist()):
            x = a[expert, :rows].float() * sfa[expert, :rows].repeat_interleave(128, 1)
            w = dequantize_fp8(b[expert], sfb[expert], torch.float32)
            d[expert, :rows] = (x @ w.T).to(d.dtype)


def _weights(experts: int, hidden: int, inter: int, tile: int, block: int, g: torch.Generator) -> ExpertWeights:
    def stack(rows, cols):
        pairs = [quantize_fp8(torch.randn(rows, cols, generator=g) * cols**-0.5, tile, tile) for _ in range(experts)]
        return torch.stack([w for w, _ in pairs]).to(DEVICE), torch.stack([s for _, s in pairs]).to(DEVICE)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)
    return ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, block)


def _close(ours: torch.Tensor, reference: torch.Tensor, bf16_products: bool, wgmma: bool = False) -> None:
    assert ours.shape == reference.shape and ours.dtype == reference.dtype and torch.isfinite(ours).all()
    rounding = 2**-7 if ours.dtype == torch.bfloat16 else 0.0  # an ulp of the output's dtype
    ours, reference = ours.float(), reference.float()
    if wgmma:
        # Hopper's FP8 wgmma (64-row blocks) sums each 128-column chunk at reduced precision before the fp32
        # promotion: ~1e-4 of a chunk's sum, and a last bit of gate or up moves some of SwiGLU's FP8 roundings by
        # a step. On the H200: ~1.1e-3 of the output's norm, where a wrong row, weight or scale gives 100%
        assert (ours - reference).norm() <= 5e-3 * reference.norm()
        return
    if bf16_products:
        # DeepGEMM writes gate and up in bf16 (as DeepSeek's inference code has them): SwiGLU's output moves by
        # ~0.4%, which moves ~5% of its FP8 roundings by one e4m3 step: ~2% of the output's norm, where a wrong
        # weight, row or count gives 100%
        assert (ours - reference).norm() <= 0.03 * reference.norm()
        return
    # the reference's products in another fp32 summation order, plus the output dtype's rounding
    tolerance = 1e-4 * reference.abs().amax() + reference.abs() * rounding
    assert torch.all((ours - reference).abs() <= tolerance)


# (tokens, experts, top-k, hidden, intermediate, weight tile, activation block)
SHAPES = [(5, 4, 2, 64, 32, 32, 32), (19, 8, 2, 256, 128, 128, 128), (1, 8, 3, 64, 64, 32, 32),
          (40, 4, 2, 128, 64, 64, 128)]
if CUDA:
    SHAPES += [(64, 16, 6, 1024, 512, 128, 128), (300, 16, 6, 1024, 512, 128, 128), (1, 64, 6, 2048, 1024, 128, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, tile, block", SHAPES)
def test_triton_fp8_experts_match_the_reference(tokens, experts, top_k, hidden, inter, tile, block, dtype):
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    weights = _weights(experts, hidden, inter, tile, block, g)
    x, ids, topk_weights = _inputs(tokens, experts, top_k, hidden, dtype, g)
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)  # poison what the kernels allocate next
    ours = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    wgmma = CUDA and block_rows(tokens * top_k, experts) == LARGE_BM  # on the GPU: 64-row blocks take wgmma
    _close(ours, TorchMoE().routed_experts(x, ids, topk_weights, weights), bf16_products=False, wgmma=wgmma)


def test_masked_gemm_serves_decode_steps_with_its_recipe():
    g = torch.Generator().manual_seed(5)
    weights = _weights(4, 256, 128, 128, 128, g)
    assert moe_fp8.masked_serves(1, weights) and moe_fp8.masked_serves(moe_fp8.MASKED_MAX_TOKENS, weights)
    assert not moe_fp8.masked_serves(moe_fp8.MASKED_MAX_TOKENS + 1, weights)  # slabs of every expert grow with T
    assert not moe_fp8.masked_serves(1, _weights(4, 256, 128, 64, 128, g))  # 64 x 64 tiles: not DeepGEMM's recipe
    assert not moe_fp8.masked_serves(1, _weights(4, 256, 128, 128, 32, g))  # 1 x 32 activation blocks


@pytest.mark.parametrize("tokens, top_k", [(1, 2), (7, 3), (16, 4)])
def test_masked_experts_match_the_reference(tokens, top_k):
    """Each expert's rows in its own slab, counts on the device: the stand-in NaNs every row past them."""
    experts, hidden, inter = 8, 256, 128
    g = torch.Generator().manual_seed(tokens)
    weights = _weights(experts, hidden, inter, 128, 128, g)
    x, ids, topk_weights = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
    ids[0, 0] = ids[-1, 0] = experts - 1  # some expert gets two tokens (or one twice at batch 1: distinct slots)
    if tokens == 1:
        ids[0, 1] = 0
    gemm = MaskedStandIn()
    moe = TritonMoE(TorchMoE(), masked_gemm=gemm, masked_align=ALIGN)
    ours = moe.routed_experts(x, ids, topk_weights, weights)
    assert gemm.calls == 3  # w1, w3, w2
    _close(ours, TorchMoE().routed_experts(x, ids, topk_weights, weights), bf16_products=True)


def test_narrow_tiles_fall_back_to_the_reference_with_a_warning(monkeypatch):
    """FP8 tensor cores take 32 columns at a time: 16-column tiles on such a GPU go to the reference, said once."""
    warnings = []
    monkeypatch.setattr(moe_module, "log_once", lambda logger, level, message: warnings.append(message))
    monkeypatch.setattr(moe_fp8, "_native_fp8", lambda device: True)
    g = torch.Generator().manual_seed(3)
    weights = _weights(4, 64, 32, 16, 16, g)
    x, ids, topk_weights = _inputs(3, 4, 2, 64, torch.float32, g)
    ours = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    assert torch.equal(ours, TorchMoE().routed_experts(x, ids, topk_weights, weights))
    assert len(warnings) == 1 and "float8_e4m3fn" in warnings[0] and "32 columns" in warnings[0]


@pytest.mark.skipif(not DEEPGEMM, reason="DeepGEMM on a GPU")
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_deepgemm_masked_experts_match_the_reference_and_replay(tokens):
    """V4-Flash-Base's widths: DeepGEMM's masked GEMM eagerly, then captured in a CUDA graph and replayed with
    other routing, against the reference each time."""
    experts, top_k, hidden, inter = 32, 6, 4096, 2048
    g = torch.Generator().manual_seed(tokens + 1)
    weights = _weights(experts, hidden, inter, 128, 128, g)
    gemm, align = masked_fp8_gemm()
    moe = TritonMoE(TorchMoE(), masked_gemm=gemm, masked_align=align)
    x, ids, topk_weights = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
    _close(moe.routed_experts(x, ids, topk_weights, weights),
           TorchMoE().routed_experts(x, ids, topk_weights, weights), bf16_products=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(x, ids, topk_weights, weights)
    new_x, new_ids, new_weights = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
    x.copy_(new_x)
    ids.copy_(new_ids)
    topk_weights.copy_(new_weights)
    graph.replay()
    _close(out, TorchMoE().routed_experts(x, ids, topk_weights, weights), bf16_products=True)
