"""The FP8 KV cache layout (``deepinfer.runtime.fp8_kv``, FlashMLA's V4 layout): bytes where FlashMLA reads them,
values within e4m3 rounding, writes that touch only their own rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.runtime import fp8_kv


def _rows(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-6, 6, (tokens, 1), generator=g).float())  # tiles of very different sizes
    return (torch.randn(tokens, 512, generator=g) * scales).to(torch.bfloat16)


def _pool(rows: int) -> fp8_kv.FP8Rows:
    return fp8_kv.FP8Rows.zeros(rows)


def test_rows_read_back_within_fp8_rounding():
    rows = _rows(150, 0)
    pool = _pool(150)
    pool.write(torch.arange(150), rows)
    back = pool[torch.arange(150)]
    assert torch.equal(back[:, 448:], rows[:, 448:])  # RoPE channels stay bf16
    nope, restored = rows[:, :448].float().unflatten(-1, (7, 64)), back[:, :448].float().unflatten(-1, (7, 64))
    # e4m3 keeps 3 mantissa bits: within 1/16 of the tile's largest magnitude, ~2% of a value on average
    assert ((restored - nope).abs() <= nope.abs().amax(-1, keepdim=True) / 16).all()
    assert (restored - nope).abs().mean() < 0.04 * nope.abs().mean()


def test_page_layout_is_rows_then_scales():
    rows = _rows(70, 1)
    pool = _pool(70)
    pool.write(torch.arange(70), rows)
    assert pool.data.shape[1] % 576 == 0 and pool.data.shape[1] >= 64 * 584
    token = 69  # page 1, offset 5: its [NoPE | RoPE] row, then (after all 64 of the page's rows) its exponents
    page = pool.data[1]
    assert torch.equal(page[5 * 576 + 448 : 6 * 576], rows[token, 448:].contiguous().view(torch.uint8))
    exponents = page[64 * 576 + 5 * 8 : 64 * 576 + 5 * 8 + 7].int() - 127
    tile_max = rows[token, :448].float().unflatten(-1, (7, 64)).abs().amax(-1)
    assert torch.equal(exponents.float(), torch.ceil(torch.log2(tile_max / 448)))
    view = pool.flashmla_view()
    assert view.shape == (2, 64, 1, 584) and view.stride() == (pool.data.shape[1], 584, 584, 1)


def test_a_write_changes_only_its_rows():
    pool = _pool(128)
    pool.write(torch.arange(128), _rows(128, 2))
    before = pool[torch.arange(128)]
    pool.write(torch.tensor([3, 100]), _rows(2, 3))
    after = pool[torch.arange(128)]
    changed = (after != before).any(-1).nonzero().flatten().tolist()
    assert changed == [3, 100]


def test_store_writes_plain_tensors_in_their_dtype_and_fp8_rows_quantized():
    rows = _rows(4, 4)
    plain = torch.zeros(8, 512, dtype=torch.float32)
    fp8_kv.store(plain, torch.tensor([1, 2, 5, 7]), rows)
    assert torch.equal(plain[[1, 2, 5, 7]], rows.float())
    pool = _pool(8)
    fp8_kv.store(pool, torch.tensor([1, 2, 5, 7]), rows)
    assert torch.equal(pool[torch.tensor([1, 2, 5, 7])][:, 448:], rows[:, 448:])


def test_rows_of_another_width_are_refused():
    with pytest.raises(ValueError, match="512-wide"):
        fp8_kv.quantize(torch.zeros(2, 576))
