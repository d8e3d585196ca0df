"""Long prefills' routed experts through a grouped GEMM with DeepGEMM's contiguous-layout contract
(``deepinfer_nvidia.moe_grouped``) against the torch reference MoE.

On a CPU (Triton's interpreter) a torch stand-in plays DeepGEMM, keeping its contract's edges: rows whose layout is
-1 inside a computed block get garbage (NaN here), blocks whose first row is -1 get zeros. On a GPU where build.sh
provisioned DeepGEMM, its own kernel runs.
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
from deepinfer_nvidia import moe_grouped  # noqa: E402
from deepinfer_nvidia.deepseek_kernels import grouped_bf16_gemm  # noqa: E402
from deepinfer_nvidia.moe import TritonMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ALIGN = 16  # the stand-in's M alignment (DeepGEMM's own is 128 on SM90)


class StandIn:
    """``m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)`` in torch, counting its calls."""

    def __init__(self, align: int = ALIGN):
        self.align, self.calls = align, 0

    def __call__(self, a, b, d, layout):
        assert a.dtype == b.dtype == d.dtype == torch.bfloat16 and layout.dtype == torch.int32
        assert layout.numel() == len(a) == len(d) and len(a) % self.align == 0 and a.is_contiguous()
        self.calls += 1
        computed = (layout.view(-1, self.align)[:, :1] >= 0).expand(-1, self.align).flatten()
        rows = layout >= 0
        d[rows] = (a[rows].float().unsqueeze(1) @ b[layout[rows].long()].float().transpose(1, 2)).squeeze(1).to(d.dtype)
        d[computed & ~rows] = float("nan")
        d[~computed] = 0


def _weights(fmt, experts, hidden, inter, g):
    def weight(rows, cols):
        return torch.randn(experts, rows, cols, generator=g) * cols**-0.5

    if fmt == "bf16":
        return ExpertWeights(*(weight(r, c).to(torch.bfloat16).to(DEVICE) for r, c in
                               ((inter, hidden), (inter, hidden), (hidden, inter))), 10.0)

    def packed(rows, cols):
        codes, scales = zip(*(quantize_fp4(w.to(DEVICE)) for w in weight(rows, cols)))
        return torch.stack(codes), torch.stack(scales)

    (w1, s1), (w3, s3), (w2, s2) = packed(inter, hidden), packed(inter, hidden), packed(hidden, inter)
    return ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 64)


def _routing(tokens, experts, top_k, hidden, dtype, g, skew=False):
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    scores = torch.rand(tokens, experts, generator=g)
    if skew:  # one expert in every token's top-k, a few experts with no rows at all
        scores[:, 0] += 2
        scores[:, -3:] -= 2
    ids = scores.argsort(1, descending=True)[:, :top_k]
    return x.to(DEVICE), ids.to(DEVICE), torch.rand(tokens, top_k, generator=g).to(DEVICE)


def _close(ours, reference, fmt):
    assert ours.shape == reference.shape and ours.dtype == reference.dtype and torch.isfinite(ours).all()
    ours, reference = ours.float(), reference.float()
    if fmt == "bf16":  # gate, up, SwiGLU's output and down rounded to bf16: ~0.7% (Triton's kernel: ~0.4%)
        assert (ours - reference).norm() <= 2**-6 * reference.norm()
    else:
        # the bf16 gate and up (as DeepSeek's inference code has them) move SwiGLU's output by ~0.4%, which moves
        # ~5% of its FP8 roundings by one e4m3 step: ~2% of the output's norm, where the reference's fp32 gate
        # and up and a wrong weight or row give 100%
        assert (ours - reference).norm() <= 0.03 * reference.norm()


@pytest.mark.parametrize("fmt, dtype, experts, top_k, chunk", [
    ("bf16", torch.bfloat16, 8, 2, 32), ("bf16", torch.bfloat16, 12, 4, 5), ("mxfp4", torch.float32, 8, 2, 32),
    ("mxfp4", torch.bfloat16, 8, 2, 3), ("mxfp4", torch.bfloat16, 12, 4, 5)])
def test_grouped_experts_match_the_reference(fmt, dtype, experts, top_k, chunk):
    """Uneven routing, empty experts, and MXFP4 chunks of 3 or 5 experts (a partial last chunk): each chunk's GEMM
    must leave the others' rows as they are."""
    g = torch.Generator().manual_seed(experts * 7 + top_k)
    hidden, inter, tokens = 128, 64, 6 * experts
    weights = _weights(fmt, experts, hidden, inter, g)
    x, ids, topk_weights = _routing(tokens, experts, top_k, hidden, dtype, g, skew=True)
    gemm = StandIn()
    ours = moe_grouped.routed_experts(gemm, ALIGN, x, ids, topk_weights, weights, chunk_experts=chunk)
    # chunks without rows (the skew leaves the last experts empty) are neither dequantized nor multiplied
    chunks = len((ids.flatten() // chunk).unique()) if fmt == "mxfp4" else 1
    assert gemm.calls == 3 * chunks and (fmt == "bf16" or chunk >= experts or chunks < -(-experts // chunk))
    _close(ours, TorchMoE().routed_experts(x, ids, topk_weights, weights), fmt)


def test_triton_moe_takes_the_grouped_gemm_from_enough_rows_per_expert(monkeypatch):
    monkeypatch.setattr(moe_grouped, "MIN_WIDTH", 64)  # tiny widths, to run in the interpreter
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, top_k = 8, 128, 64, 2
    weights = _weights("bf16", experts, hidden, inter, g)
    gemm = StandIn()
    moe = TritonMoE(TorchMoE(), grouped_gemm=gemm, grouped_align=ALIGN)
    at_threshold = moe_grouped.MIN_ROWS_PER_EXPERT["bf16"] * experts // top_k
    for tokens, grouped in ((at_threshold - 1, False), (at_threshold, True)):
        x, ids, topk_weights = _routing(tokens, experts, top_k, hidden, torch.bfloat16, g)
        calls = gemm.calls
        reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)
        _close(moe.routed_experts(x, ids, topk_weights, weights), reference, "bf16")
        assert (gemm.calls > calls) == grouped
    pinned = TritonMoE(TorchMoE(), pinned=True, grouped_gemm=gemm, grouped_align=ALIGN)
    assert pinned.grouped_gemm is None  # batch-invariant mode keeps one kernel whatever the batch


def test_small_or_untiled_widths_and_float32_stay_on_triton():
    def experts(hidden, inter, dtype=torch.bfloat16):  # serves() reads shapes and dtypes only
        return ExpertWeights(torch.empty(4, inter, hidden, dtype=dtype), torch.empty(4, inter, hidden, dtype=dtype),
                             torch.empty(4, hidden, inter, dtype=dtype), 10.0)

    assert moe_grouped.serves(10_000, experts(1024, 1024))
    assert not moe_grouped.serves(10_000, experts(1024 + 32, 1024))  # not whole 64-column tiles
    assert not moe_grouped.serves(10_000, experts(256, 128))  # the embedded model's experts
    assert not moe_grouped.serves(10_000, experts(1024, 1024, torch.float32))
    assert not moe_grouped.serves(100, experts(1024, 1024))  # too few rows per expert


@pytest.mark.parametrize("tokens, experts, top_k, align", [(1, 4, 1, 16), (37, 8, 3, 16), (300, 64, 6, 128)])
def test_contiguous_layout_pads_each_expert_to_the_alignment(tokens, experts, top_k, align):
    ids = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(tokens)).argsort(1)[:, :top_k]
    chunk = 3
    padded_row, layout, bounds = moe_grouped.contiguous_layout(ids, experts, align, chunk)
    flat = ids.flatten()
    assert padded_row.unique().numel() == flat.numel()  # one row each
    assert torch.equal(layout[padded_row], (flat % chunk).int()) and int((layout >= 0).sum()) == flat.numel()
    assert len(layout) == bounds[-1] and len(bounds) == experts + 1
    for expert in range(experts):
        rows = padded_row[flat == expert]
        count = len(rows)
        # from the expert's aligned first row, in the flattened order (a stable sort), padded to the alignment
        assert bounds[expert] % align == 0 and bounds[expert + 1] - bounds[expert] == -(-count // align) * align
        assert torch.equal(rows, torch.arange(bounds[expert], bounds[expert] + count))


@pytest.mark.parametrize("experts, rows, cols", [(3, 5, 64), (2, 3, 96), (1, 2, 2048)])
def test_fp4_dequantization_is_exact(experts, rows, cols):
    g = torch.Generator().manual_seed(cols)
    codes, scales = zip(*(quantize_fp4((torch.randn(rows, cols, generator=g) * 4).to(DEVICE)) for _ in range(experts)))
    codes, scales = torch.stack(codes), torch.stack(scales)
    expected = torch.stack([dequantize_fp4(c, s, torch.bfloat16) for c, s in zip(codes, scales)])
    assert torch.equal(moe_grouped.dequantize_fp4_experts(codes, scales), expected)
    scratch = torch.full((experts + 1, rows, cols), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(moe_grouped.dequantize_fp4_experts(codes[1:], scales[1:], scratch), expected[1:])


@pytest.mark.skipif(not CUDA or grouped_bf16_gemm()[0] is None, reason="DeepGEMM on a GPU")
@pytest.mark.parametrize("fmt, chunk", [("bf16", 32), ("mxfp4", 32), ("mxfp4", 12)])
def test_deepgemm_grouped_experts_match_the_reference(fmt, chunk):
    gemm, align = grouped_bf16_gemm()
    g = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens, top_k = 32, 1024, 512, 1024, 6
    weights = _weights(fmt, experts, hidden, inter, g)
    x, ids, topk_weights = _routing(tokens, experts, top_k, hidden, torch.bfloat16, g, skew=True)
    torch.full((1 << 28,), float("nan"), device=DEVICE)  # poison what the kernels allocate next
    ours = moe_grouped.routed_experts(gemm, align, x, ids, topk_weights, weights, chunk_experts=chunk)
    _close(ours, TorchMoE().routed_experts(x, ids, topk_weights, weights), fmt)


def test_fp4_dequantization_of_every_byte_at_extreme_scales():
    """Every code pair (signed zeros included) at the smallest (2^-127, subnormal), largest and ordinary scales."""
    exponents = torch.tensor([0, 1, 100, 127, 200, 253, 254], dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).repeat(len(exponents), 1)
    scales = exponents.repeat_interleave(16).view(len(exponents), 16).view(torch.float8_e8m0fnu)
    codes, scales = codes.view(1, len(exponents), 256).to(DEVICE), scales.view(1, len(exponents), 16).to(DEVICE)
    ours = moe_grouped.dequantize_fp4_experts(codes, scales)[0]
    expected = dequantize_fp4(codes[0], scales[0], torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))  # bit for bit: -0.0 and inf too


@pytest.mark.skipif(not CUDA or grouped_bf16_gemm()[0] is None, reason="DeepGEMM on a GPU")
def test_a_captured_call_keeps_the_triton_path():
    """A CUDA graph cannot hold the grouped path's host synchronisation: while capturing, the Triton kernel serves
    even a call with enough rows per expert (the engine captures decode batches, never prefills)."""
    gemm, align = grouped_bf16_gemm()
    g = torch.Generator().manual_seed(6)
    experts, hidden, inter, tokens, top_k = 16, 1024, 1024, 512, 2
    weights = _weights("bf16", experts, hidden, inter, g)
    x, ids, topk_weights = _routing(tokens, experts, top_k, hidden, torch.bfloat16, g)
    assert moe_grouped.serves(ids.numel(), weights)
    moe = TritonMoE(TorchMoE(), grouped_gemm=gemm, grouped_align=align)
    TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)  # compiles the Triton path before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(x, ids, topk_weights, weights)
    graph.replay()
    _close(out, TorchMoE().routed_experts(x, ids, topk_weights, weights), "bf16")
