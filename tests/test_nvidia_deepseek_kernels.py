"""DeepSeek's kernels in the NVIDIA plugin: the MODEL1 FP8 KV layout FlashMLA reads (on any machine), the loader's
report, and, on a GPU where build.sh provisioned FlashMLA, its sparse decode against the reference attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.plugins.builtin.torch_attention import TorchAttention  # noqa: E402
from deepinfer_nvidia import deepseek_kernels as dk  # noqa: E402


def _rows(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-6, 6, (tokens, 1), generator=g).float())  # tiles of very different sizes
    return (torch.randn(tokens, 512, generator=g) * scales).to(torch.bfloat16)


def test_kv_layout_round_trips_within_fp8_rounding():
    rows = _rows(2 * 64, 0)
    cache = dk.pack_kv(rows, page=64)
    assert cache.shape == (2, 64, 1, 584) and cache.stride(1) == 584 and cache.stride(0) % 576 == 0
    back = dk.unpack_kv(cache)
    assert torch.equal(back[:, 448:], rows[:, 448:])  # RoPE channels stay bf16
    nope, restored = rows[:, :448].float().unflatten(-1, (7, 64)), back[:, :448].float().unflatten(-1, (7, 64))
    # e4m3 keeps 3 mantissa bits: within 1/16 of the tile's largest magnitude, far tighter for most values
    bound = nope.abs().amax(-1, keepdim=True) / 16
    assert ((restored - nope).abs() <= bound).all()
    assert (restored - nope).abs().mean() < 0.04 * nope.abs().mean()  # e4m3: ~2% on average


def test_kv_layout_puts_rows_then_scales_in_each_page():
    rows = _rows(64, 1)
    cache = dk.pack_kv(rows, page=64)
    flat = cache.view(torch.uint8).as_strided((cache.stride(0),), (1,))
    token = 5  # its [NoPE | RoPE] row, then (after every token's row) its scale exponents
    assert torch.equal(flat[token * 576 + 448 : token * 576 + 576], rows[token, 448:].contiguous().view(torch.uint8))
    exponents = flat[64 * 576 + token * 8 : 64 * 576 + token * 8 + 7].int() - 127
    tile_max = rows[token, :448].float().unflatten(-1, (7, 64)).abs().amax(-1)
    assert torch.equal(exponents.float(), torch.ceil(torch.log2(tile_max / 448)))


def test_pack_refuses_rows_it_cannot_lay_out():
    with pytest.raises(ValueError, match="512"):
        dk.pack_kv(torch.zeros(64, 576, dtype=torch.bfloat16), page=64)


def test_report_names_each_library():
    line = dk.report()
    assert "FlashMLA:" in line and "DeepGEMM:" in line


@pytest.mark.skipif(not torch.cuda.is_available() or dk.flash_mla()[0] is None, reason="needs FlashMLA on a GPU")
@pytest.mark.parametrize("batch", [1, 16])
def test_flashmla_sparse_decode_matches_the_reference(batch):
    g = torch.Generator().manual_seed(batch)
    pages, page, heads, window, topk = 16, 64, 64, 128, 512
    rows = _rows(pages * page, 2)
    cache, window_cache = dk.pack_kv(rows, page).cuda(), dk.pack_kv(rows[: 4 * page], page).cuda()
    q = (torch.randn(batch, 1, heads, 512, generator=g) / 8).to(torch.bfloat16).cuda()
    indices = torch.randint(0, pages * page, (batch, 1, topk), generator=g, dtype=torch.int32)
    window_indices = torch.randint(0, 4 * page, (batch, 1, window), generator=g, dtype=torch.int32)
    indices[:, :, -7:] = -1  # masked entries
    sinks = torch.randn(heads, generator=g).cuda()
    scale = 512**-0.5
    sparse_decode, _ = dk.flash_mla()
    ours = sparse_decode(q, cache, indices.cuda(), sinks, scale, window_cache, window_indices.cuda())
    keys, window_keys = dk.unpack_kv(cache).cuda(), dk.unpack_kv(window_cache).cuda()
    expected = TorchAttention().sparse_attention(
        q[:, 0], [(keys, indices[:, 0].long().cuda()), (window_keys, window_indices[:, 0].long().cuda())], sinks, scale)
    assert (ours[:, 0].float() - expected.float()).abs().max() <= 2e-2 * expected.float().abs().max()
