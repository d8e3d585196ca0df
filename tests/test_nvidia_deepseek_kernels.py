"""DeepSeek's kernels in the NVIDIA plugin: the loader's report, and, on a GPU where build.sh provisioned FlashMLA,
its sparse decode over the engine's FP8 KV layout (``deepinfer.runtime.fp8_kv``) against the reference attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.runtime.fp8_kv import FP8Rows  # noqa: E402
from deepinfer.plugins.builtin.torch_attention import TorchAttention  # noqa: E402
from deepinfer_nvidia import deepseek_kernels as dk  # noqa: E402


def _cache(rows: torch.Tensor) -> FP8Rows:
    pool = FP8Rows.zeros(len(rows), rows.device)
    pool.write(torch.arange(len(rows), device=rows.device), rows)
    return pool


def test_report_names_each_library():
    line = dk.report()
    assert "FlashMLA:" in line and "DeepGEMM:" in line


def test_triton_only_at_run_time(monkeypatch):
    """DEEPINFER_KERNELS=triton leaves DeepSeek's kernels unused even where build.sh installed them, and says so."""
    from deepinfer import envs

    def reload():
        envs.reload()
        dk.flash_mla.cache_clear()
        dk.flash_mla_prefill.cache_clear()
        dk.deep_gemm.cache_clear()

    monkeypatch.setenv("DEEPINFER_KERNELS", "triton")
    reload()
    try:
        assert dk.flash_mla()[0] is None and dk.flash_mla_prefill()[0] is None and dk.deep_gemm()[0] is None
        assert dk.report().count("DEEPINFER_KERNELS=triton") == 2
    finally:
        monkeypatch.undo()
        reload()


@pytest.mark.skipif(not torch.cuda.is_available() or dk.flash_mla()[0] is None, reason="needs FlashMLA on a GPU")
@pytest.mark.parametrize("batch", [1, 16])
def test_flashmla_sparse_decode_matches_the_reference(batch):
    g = torch.Generator().manual_seed(batch)
    pages, page, heads, window, topk = 16, 64, 64, 128, 512
    rows = torch.randn(pages * page, 512, generator=g).to(torch.bfloat16).cuda()
    cache, window_cache = _cache(rows), _cache(rows[: 4 * page])
    q = (torch.randn(batch, 1, heads, 512, generator=g) / 8).to(torch.bfloat16).cuda()
    indices = torch.randint(0, pages * page, (batch, 1, topk), generator=g, dtype=torch.int32)
    window_indices = torch.randint(0, 4 * page, (batch, 1, window), generator=g, dtype=torch.int32)
    indices[:, :, -7:] = -1  # masked entries
    sinks = torch.randn(heads, generator=g).cuda()
    scale = 512**-0.5
    sparse_decode, _ = dk.flash_mla()
    ours = sparse_decode(q, cache.flashmla_view(), indices.cuda(), sinks, scale, window_cache.flashmla_view(),
                         window_indices.cuda())
    # the reference reads the same FP8 rows (indexing FP8Rows dequantizes them)
    expected = TorchAttention().sparse_attention(
        q[:, 0], [(cache, indices[:, 0].long().cuda()), (window_cache, window_indices[:, 0].long().cuda())], sinks, scale)
    assert (ours[:, 0].float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()


@pytest.mark.skipif(not torch.cuda.is_available() or dk.flash_mla_prefill()[0] is None,
                    reason="needs FlashMLA on a GPU")
@pytest.mark.parametrize("tokens", [256, 1000])
def test_flashmla_sparse_prefill_serves_the_backend_like_the_reference(tokens):
    """The backend's calls of 256+ tokens over bf16 pools go to FlashMLA's sparse prefill (one call per pool, merged
    by their lse), on V4-Flash shapes; a query with no compressed entry and one with no key at all included."""
    from deepinfer_nvidia.attention import TritonAttention

    g = torch.Generator().manual_seed(tokens)
    heads, pool_rows = 64, 4096
    q = torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16).cuda()
    sources = []
    for width in (128, 512):
        pool = torch.randn(pool_rows, 512, generator=g).to(torch.bfloat16).cuda()
        idx = torch.randint(0, pool_rows, (tokens, width), generator=g)
        sources.append((pool, idx.masked_fill(torch.rand(tokens, width, generator=g) < 0.2, -1).cuda()))
    sources[1][1][0] = -1
    sources[0][1][1] = -1
    sources[1][1][1] = -1
    sinks = torch.randn(heads, generator=g).cuda()
    torch.full((1 << 26,), float("nan"), device="cuda")  # NaNs where the next buffers come from
    ours = TritonAttention(flash_mla_prefill=dk.flash_mla_prefill()[0]).sparse_attention(q, sources, sinks, 0.05)
    expected = TorchAttention().sparse_attention(q, sources, sinks, 0.05)
    assert torch.all(ours[1] == 0) and torch.isfinite(ours).all()
    assert (ours.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
    for width in (128, 640):  # a lone source: FlashMLA applies the sinks itself
        lone = [(sources[1][0], torch.cat([sources[1][1], sources[0][1]], 1)[:, :width])]
        ours = TritonAttention(flash_mla_prefill=dk.flash_mla_prefill()[0]).sparse_attention(q, lone, sinks, 0.05)
        expected = TorchAttention().sparse_attention(q, lone, sinks, 0.05)
        assert (ours.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()
