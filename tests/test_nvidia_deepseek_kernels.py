"""DeepSeek's kernels in the NVIDIA plugin: the loader's report, and, on a GPU where build.sh provisioned FlashMLA,
its sparse decode over the engine's FP8 KV layout (``deepinfer.core.fp8_kv``) against the reference attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.core.fp8_kv import FP8Rows  # noqa: E402
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
        dk.deep_gemm.cache_clear()

    monkeypatch.setenv("DEEPINFER_KERNELS", "triton")
    reload()
    try:
        assert dk.flash_mla()[0] is None and dk.deep_gemm()[0] is None
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
