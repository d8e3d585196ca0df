"""The NVIDIA backend's kernels in batch-invariant mode: a row's output is bitwise the same whatever the batch around
it, and still matches the torch reference. Attention also runs in Triton's interpreter at tiny shapes; the pinned
GEMM and MoE configurations differ from the interpreter's only on a GPU, so those tests need one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py turns Triton's interpreter on without a GPU"
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.quantization import blockwise_linear, quantize_fp4, quantize_fp8  # noqa: E402
from deepinfer.plugins.builtin.torch_attention import TorchAttention  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia.fp8_linear import TritonLinear  # noqa: E402
from deepinfer_nvidia.moe import TritonMoE  # noqa: E402
from deepinfer_nvidia.attention import TritonAttention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_gpu = pytest.mark.skipif(not CUDA, reason="the pinned configurations differ from the interpreter's only on a GPU")


def _poison() -> None:
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_attention_with_a_fixed_split_size_ignores_the_batch(dtype):
    g = torch.Generator().manual_seed(5)
    heads, dim, window, selected, rows = (64, 512, 128, 512, 4096) if CUDA else (16, 32, 16, 40, 300)
    pool = torch.randn(rows, dim, generator=g).to(DEVICE, dtype)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    q = torch.randn(64, heads, dim, generator=g).to(DEVICE, dtype)
    windows = torch.randint(0, rows, (64, window), generator=g).to(DEVICE)
    entries = torch.randint(0, rows, (64, selected), generator=g)
    entries = entries.masked_fill(torch.rand(64, selected, generator=g) < 0.3, -1).to(DEVICE)
    attention = TritonAttention(tiles_per_split=2)
    _poison()
    alone = attention.sparse_attention(q[:1], [(pool, windows[:1]), (pool, entries[:1])], sinks, 0.05)
    reference = TorchAttention().sparse_attention(q[:1].float(), [(pool.float(), windows[:1]), (pool.float(), entries[:1])],
                                                  sinks, 0.05)
    torch.testing.assert_close(alone.float(), reference, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    for tokens in (2, 17, 64) if CUDA else (2, 5, 17):  # the interpreter's time grows with the tokens
        for extra in (0, 37, 300):  # a wider batch pads every index list
            sources = [(pool, windows[:tokens]), (pool, F.pad(entries[:tokens], (0, extra), value=-1))]
            _poison()
            assert torch.equal(attention.sparse_attention(q[:tokens], sources, sinks, 0.05)[:1], alone), (tokens, extra)


@needs_gpu
@pytest.mark.parametrize("out, cols, block", [(4096, 7168, 128), (3072, 5120, 32)])
def test_pinned_fp8_gemm_ignores_the_token_count(out, cols, block):
    g = torch.Generator().manual_seed(out)
    weight, scale = quantize_fp8(torch.randn(out, cols, generator=g) * cols**-0.5, block, block)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    x = torch.randn(300, cols, generator=g).to(DEVICE, torch.bfloat16)
    linear = TritonLinear(pinned=True)
    first = linear.linear(x[:1], weight, scale, block)
    for tokens in (2, 16, 65, 129, 300):
        _poison()
        assert torch.equal(linear.linear(x[:tokens], weight, scale, block)[:1], first), tokens
    reference = blockwise_linear(x[:1].float(), weight, scale, block)
    torch.testing.assert_close(first.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@needs_gpu
@pytest.mark.parametrize("fmt", ["mxfp4", torch.bfloat16])
def test_pinned_experts_ignore_the_token_count(fmt):
    g = torch.Generator().manual_seed(9)
    experts, hidden, inter, top_k = 16, 1024, 512, 6

    def weight(rows, cols):
        return torch.randn(experts, rows, cols, generator=g) * cols**-0.5

    if fmt == "mxfp4":
        packed = [list(zip(*(quantize_fp4(w.to(DEVICE)) for w in weight(r, c))))
                  for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
        (w1, s1), (w3, s3), (w2, s2) = [(torch.stack(codes), torch.stack(scales)) for codes, scales in packed]
        weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128)
    else:
        weights = ExpertWeights(*(weight(r, c).to(fmt).to(DEVICE) for r, c in ((inter, hidden),) * 2 + ((hidden, inter),)),
                                10.0)
    tokens = 1024  # past 32 rows per expert, where the unpinned kernels switch to 64-row blocks
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].to(DEVICE)
    topk_weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    moe = TritonMoE(TorchMoE(), pinned=True)
    first = moe.routed_experts(x[:1], ids[:1], topk_weights[:1], weights)
    for count in (2, 16, 100, 1024):
        _poison()
        assert torch.equal(moe.routed_experts(x[:count], ids[:count], topk_weights[:count], weights)[:1], first), count
    reference = TorchMoE().routed_experts(x[:1], ids[:1], topk_weights[:1], weights)
    torch.testing.assert_close(first.float(), reference.float(), rtol=2e-2, atol=2e-2 * reference.abs().max().item())
