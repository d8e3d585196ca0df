"""The NVIDIA backend's Triton sparse attention and indexer against the torch reference.

Natively on a GPU (with real DeepSeek-V4 shapes and a CUDA-graph capture), in Triton's interpreter elsewhere at tiny
shapes (conftest turns it on); skipped without triton.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py turns Triton's interpreter on without a GPU"
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.engine.config import EngineConfig  # noqa: E402
from deepinfer.runtime.fp8_kv import PAGE_BYTES, FP8Rows, storage_shape  # noqa: E402
from deepinfer.plugins.builtin.torch_attention import TorchAttention  # noqa: E402
from deepinfer_nvidia import plugin  # noqa: E402
from deepinfer_nvidia.attention import TritonAttention  # noqa: E402
from deepinfer_nvidia.sparse_attention import decode_splits, sparse_attention  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
REFERENCE = TorchAttention()
# (tokens, heads, dim, keys per source, pool rows, block_h, splits); None = the backend's own choice.
# Few pool rows make duplicate indices certain; block_h / splits force several head blocks and merged splits.
SHAPES = [(1, 16, 32, (20,), 12, None, None), (3, 32, 64, (9, 24), 30, None, None),
          (17, 16, 64, (16, 40), 50, None, None), (3, 32, 32, (70, 5), 40, 16, 3),
          (1, 20, 32, (33, 7, 12), 25, None, None), (2, 16, 32, (12, 0), 10, None, 2)]
if CUDA:  # V4-Flash: 64 heads of 512, a 128-key window plus 512 selected entries
    SHAPES += [(t, 64, 512, (128, 512), 4096, None, None) for t in (1, 16, 128)]
    SHAPES += [(64, 64, 512, (128,), 2048, None, None), (1, 64, 512, (128, 2048), 2048, None, None)]


def _poison() -> None:
    """Leave NaNs where the caching allocator will hand out the kernels' next buffers."""
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)


def _indices(tokens: int, keys: int, rows: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, rows, (tokens, keys), generator=g)
    return idx.masked_fill(torch.rand(tokens, keys, generator=g) < 0.3, -1)  # padding anywhere, not only at the end


def _attention_inputs(tokens, heads, dim, widths, rows, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=g)
    sources = [(torch.randn(rows, dim, generator=g).to(dtype).to(DEVICE), _indices(tokens, k, rows, g).to(DEVICE))
               for k in widths]
    for _, idx in sources:
        idx[tokens // 2] = -1  # one query sees no key at all: only its sink is left
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    return q.to(dtype).to(DEVICE), sources, sinks


def _tolerance(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # fp32: another summation order; bf16: one rounding of the output (and, on the GPU, of the probabilities)
    size = reference.float().abs().amax()
    return 1e-5 * size if dtype == torch.float32 else 1e-2 * size + reference.float().abs() * 2**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, dim, widths, rows, block_h, splits", SHAPES)
def test_sparse_attention_matches_the_reference(tokens, heads, dim, widths, rows, block_h, splits, dtype):
    q, sources, sinks = _attention_inputs(tokens, heads, dim, widths, rows, dtype, seed=tokens * 7 + dim + len(widths))
    scale = dim**-0.5
    _poison()
    ours = sparse_attention(q, sources, sinks, scale, block_h=block_h, splits=splits)
    reference = REFERENCE.sparse_attention(q, sources, sinks, scale)
    assert ours.dtype == dtype and ours.shape == q.shape and torch.isfinite(ours).all()
    assert torch.all(ours[tokens // 2] == 0)
    assert torch.all((ours.float() - reference.float()).abs() <= _tolerance(reference, dtype))


@pytest.mark.parametrize("tokens, heads, widths, splits", [(3, 16, (20, 70), None), (2, 16, (33,), 3),
                                                           (2, 2, (128, 256), 3), (4, 2, (128, 256), None)])
def test_fp8_pools_read_like_the_reference(tokens, heads, widths, splits):
    """Keys in the FP8 KV layout: the kernel decodes them where it gathers them; the reference reads the same
    rows dequantized (indexing ``FP8Rows``). The two-head cases have a padded decode step's shapes: a 128-row
    window and 256 candidates read through a view of a wider table, merged over splits."""
    g = torch.Generator().manual_seed(tokens + heads)
    rows = 130
    q = torch.randn(tokens, heads, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    sources = []
    for width in widths:
        pool = FP8Rows.zeros(rows, DEVICE)
        scales = torch.exp2(torch.randint(-4, 4, (rows, 1), generator=g).float())
        pool.write(torch.arange(rows, device=DEVICE), (torch.randn(rows, 512, generator=g) * scales).to(DEVICE))
        wider = torch.cat([_indices(tokens, width, rows, g), torch.zeros(tokens, 1, dtype=torch.int64)], 1)
        sources.append((pool, wider.to(DEVICE)[:, :width]))  # row stride width + 1, as the padded path's views
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    ours = sparse_attention(q, sources, sinks, 512**-0.5, splits=splits)
    reference = REFERENCE.sparse_attention(q, sources, sinks, 512**-0.5)
    assert torch.all((ours.float() - reference.float()).abs() <= _tolerance(reference, torch.bfloat16))


def test_fp8_and_row_pools_do_not_mix():
    pool = FP8Rows.zeros(1, DEVICE)
    rows = torch.zeros(8, 512, dtype=torch.bfloat16, device=DEVICE)
    idx = torch.zeros(1, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="not both"):
        sparse_attention(torch.zeros(1, 16, 512, dtype=torch.bfloat16, device=DEVICE), [(pool, idx), (rows, idx)],
                         torch.zeros(16, device=DEVICE), 0.1)


def test_the_backend_object_splits_short_decode_rows_itself():
    q, sources, sinks = _attention_inputs(1, 16, 32, (600,), 64, torch.float32, seed=5)
    q = torch.cat([q, q], dim=-1)[..., 16:48]  # strided heads
    ours = TritonAttention().sparse_attention(q, sources, sinks, 0.2)
    reference = REFERENCE.sparse_attention(q, sources, sinks, 0.2)
    assert torch.all((ours - reference).abs() <= _tolerance(reference, torch.float32))


def test_head_dims_must_suit_the_dot_tiles():
    q, sources, sinks = _attention_inputs(1, 16, 24, (4,), 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="power of two >= 16"):
        sparse_attention(q, sources, sinks, 0.1)
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonAttention().indexer_scores(torch.randn(1, 16, 8), torch.randn(1, 16), torch.randn(4, 8),
                                         torch.zeros(1, 3, dtype=torch.int64))


def _indexer_inputs(tokens, heads, dim, width, rows, dtype, seed, integers=False):
    g = torch.Generator().manual_seed(seed)
    if integers:  # every product and sum exact in fp32: scores are bit-identical, ties included
        q = torch.randint(-2, 3, (tokens, heads, dim), generator=g).float()
        keys = torch.randint(-2, 3, (rows, dim), generator=g).float()
        weights = torch.randint(-4, 5, (tokens, heads), generator=g).float() / 8
    else:
        q, keys = torch.randn(tokens, heads, dim, generator=g), torch.randn(rows, dim, generator=g)
        weights = torch.randn(tokens, heads, generator=g) * (dim * heads) ** -0.5
    candidates = _indices(tokens, width, rows, g)
    candidates[tokens // 2, width // 3:] = -1  # fewer visible candidates than top-k
    return q.to(dtype).to(DEVICE), weights.to(DEVICE), keys.to(dtype).to(DEVICE), candidates.to(DEVICE)


INDEXER_SHAPES = [(1, 16, 32, 37, 20), (5, 20, 64, 130, 90), (3, 32, 32, 600, 25)]
if CUDA:  # V4-Flash: 64 heads of 128
    INDEXER_SHAPES += [(1, 64, 128, 16384, 16384), (256, 64, 128, 4096, 8192), (2048, 64, 128, 2048, 2048)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, dim, width, rows", INDEXER_SHAPES)
def test_indexer_scores_match_the_reference(tokens, heads, dim, width, rows, dtype):
    inputs = _indexer_inputs(tokens, heads, dim, width, rows, dtype, seed=tokens + heads + width)
    _poison()
    ours = TritonAttention().indexer_scores(*inputs)
    reference = REFERENCE.indexer_scores(*inputs)
    hidden = reference == float("-inf")
    assert ours.dtype == torch.float32 and torch.equal(ours == float("-inf"), hidden)
    # bf16 inputs multiply exactly into the fp32 accumulator, so both dtypes differ only in summation order
    size = reference[~hidden].abs().amax()
    assert torch.all((ours[~hidden] - reference[~hidden]).abs() <= 1e-5 * size)


@pytest.mark.parametrize("topk", [0, 4, 11, 1000])
@pytest.mark.parametrize("tokens, heads, dim, width, rows", INDEXER_SHAPES[:2])
def test_indexer_topk_selects_like_the_reference(tokens, heads, dim, width, rows, topk):
    inputs = _indexer_inputs(tokens, heads, dim, width, rows, torch.bfloat16, seed=topk + width, integers=True)
    ours = TritonAttention().indexer_topk(*inputs, topk)
    assert torch.equal(ours, REFERENCE.indexer_topk(*inputs, topk))
    k, visible = min(topk, width), int((inputs[3][tokens // 2] >= 0).sum())
    assert ours.shape == (tokens, k) and int((ours[tokens // 2] == -1).sum()) == max(0, k - visible)


def test_plugin_answers_only_on_cuda():
    config = EngineConfig()
    assert plugin.deepinfer_attention_backend(config=config, device=torch.device("cpu")) is None
    assert isinstance(plugin.deepinfer_attention_backend(config=config, device=torch.device("cuda")), TritonAttention)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("tokens", [1, 16])
def test_cuda_graph_replays_on_new_inputs(tokens):
    backend = TritonAttention()
    q, sources, sinks = _attention_inputs(tokens, 64, 512, (128, 512), 4096, torch.bfloat16, seed=3)
    iq, weights, keys, candidates = _indexer_inputs(tokens, 64, 128, 4096, 4096, torch.bfloat16, seed=4)
    backend.sparse_attention(q, sources, sinks, 0.04)  # compile outside the capture
    backend.indexer_scores(iq, weights, keys, candidates)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.sparse_attention(q, sources, sinks, 0.04)
        scores = backend.indexer_scores(iq, weights, keys, candidates)
    q2, sources2, sinks2 = _attention_inputs(tokens, 64, 512, (128, 512), 4096, torch.bfloat16, seed=13)
    inputs2 = _indexer_inputs(tokens, 64, 128, 4096, 4096, torch.bfloat16, seed=14)
    for target, value in [(q, q2), (sinks, sinks2), (iq, inputs2[0]), (weights, inputs2[1]), (keys, inputs2[2]),
                          (candidates, inputs2[3])] + [pair for s, s2 in zip(sources, sources2) for pair in zip(s, s2)]:
        target.copy_(value)
    graph.replay()
    reference = REFERENCE.sparse_attention(q2, sources2, sinks2, 0.04)
    assert torch.all((out.float() - reference.float()).abs() <= _tolerance(reference, torch.bfloat16))
    expected = REFERENCE.indexer_scores(*inputs2)
    visible = expected > float("-inf")
    assert torch.equal(scores > float("-inf"), visible)
    assert torch.all((scores[visible] - expected[visible]).abs() <= 1e-5 * expected[visible].abs().amax())


@pytest.mark.parametrize("rows", [1, 37])
def test_fp8_store_writes_the_reference_bytes(rows):
    """One Triton program per row writes exactly the bytes ``fp8_kv.store`` does: values, exponents, RoPE, pad.
    The slots are a column of a wider tensor, as the model passes them (a token's own row ends its window)."""
    g = torch.Generator().manual_seed(rows)
    scales = torch.exp2(torch.randint(-12, 12, (rows, 1), generator=g).float())
    values = torch.randn(rows, 512, generator=g) * scales
    values[0, :64] = 0  # an all-zero tile takes the 1e-4 floor
    values[0, 64:128] = 448 * 2.0**-3  # amax / 448 exactly a power of two: no rounding up
    values = values.to(torch.bfloat16).to(DEVICE)
    window = torch.full((rows, 4), -1, dtype=torch.int64)
    window[:, -1] = torch.randperm(130, generator=g)[:rows]
    slots = window.to(DEVICE)[:, -1]

    def pool():
        return FP8Rows(torch.full(storage_shape(130), 0xA5, dtype=torch.uint8, device=DEVICE))

    ours, reference = pool(), pool()
    TritonAttention().store_rows(ours, slots, values)
    REFERENCE.store_rows(reference, slots, values)
    assert torch.equal(ours.data, reference.data)


def test_flashmla_is_handed_both_caches_with_padded_int32_indices():
    """The wiring only (FlashMLA itself is tested on a GPU): a stand-in with FlashMLA's signature reads the caches
    and index lists it is given through the reference; -1 padding to whole 64-key blocks must not change a thing."""
    def as_rows(view):  # FP8Rows back from FlashMLA's [pages, 64, 1, 584] view
        return FP8Rows(torch.as_strided(view, (view.shape[0], PAGE_BYTES), (PAGE_BYTES, 1)).view(torch.uint8))

    def stand_in(q, kv, indices, sinks, scale, extra_kv, extra_indices):
        assert indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0 and q.shape[1] == 1
        sources = [(as_rows(extra_kv), extra_indices[:, 0].long()), (as_rows(kv), indices[:, 0].long())]
        return REFERENCE.sparse_attention(q[:, 0], sources, sinks, scale).unsqueeze(1)

    g = torch.Generator().manual_seed(3)
    heads, rows = 64, 100
    q = torch.randn(2, heads, 512, generator=g).to(torch.bfloat16).to(DEVICE)
    sources = []
    for width in (30, 9):  # the window, then the compressed entries
        pool = FP8Rows.zeros(rows, DEVICE)
        pool.write(torch.arange(rows, device=DEVICE), torch.randn(rows, 512, generator=g).to(DEVICE))
        sources.append((pool, _indices(2, width, rows, g).to(DEVICE)))
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    ours = TritonAttention(flash_mla=stand_in).sparse_attention(q, sources, sinks, 0.05)
    reference = REFERENCE.sparse_attention(q, sources, sinks, 0.05)
    assert torch.allclose(ours.float(), reference.float(), atol=1e-2, rtol=0)


def _prefill_stand_in(q, kv, indices, scale, sinks):
    """``flash_mla_sparse_fwd``'s contract through fp32 torch: outputs normalized over the valid keys (times the
    sinks' factor when given), natural-log lse, +inf and zeros for a query without a valid key."""
    assert indices.dtype == torch.int32 and indices.shape[-1] % 128 == 0 and kv.shape[1] == 1
    assert q.dtype == kv.dtype == torch.bfloat16 and (sinks is None or sinks.dtype == torch.float32)
    idx = indices[:, 0].long()
    rows = kv[:, 0][idx.clamp(min=0)].float()
    logits = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("thk,tkd->thd", torch.softmax(logits, dim=-1).nan_to_num(0.0), rows)
    if sinks is not None:
        out = out * torch.sigmoid(lse - sinks)[..., None]
    return out.to(torch.bfloat16), lse.masked_fill(lse == float("-inf"), float("inf"))


@pytest.mark.parametrize("widths", [(30, 9), (40,)])
def test_flashmla_prefill_sources_are_merged_by_their_lse(widths, monkeypatch):
    """The wiring only (FlashMLA itself is tested on a GPU): one call per pool, the sinks applied by a lone source's
    call or by the merge of two; queries with no key in one source, or in both, included."""
    import deepinfer_nvidia.attention as module

    monkeypatch.setattr(module, "FLASHMLA_PREFILL_MIN_TOKENS", 1)
    q, sources, sinks = _attention_inputs(4, 64, 512, widths, 50, torch.bfloat16, seed=11)
    sources[0][1][1] = -1  # token 1 sees only the second source, token 2 (tokens // 2) nothing at all
    backend = TritonAttention(flash_mla_prefill=_prefill_stand_in)
    assert module._flashmla_prefill_serves(q, sources)
    ours = backend.sparse_attention(q, sources, sinks, 0.05)
    reference = REFERENCE.sparse_attention(q, sources, sinks, 0.05)
    assert torch.all(ours[2] == 0)
    assert torch.all((ours.float() - reference.float()).abs() <= _tolerance(reference, torch.bfloat16))
    assert not module._flashmla_prefill_serves(q.float(), [(p.float(), i) for p, i in sources])  # bf16 only


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the reference's row with no state: 0 / 0
@pytest.mark.parametrize("ratio, overlap", [(4, 2), (16, 1)])
def test_compress_pool_matches_the_reference(ratio, overlap):
    """Windows with every row, one reaching before the sequence start (-1 rows), and one with no row at all (a
    padded decode's non-closing token, whose result goes to the scratch row: the kernel skips it), on random
    state."""
    g = torch.Generator().manual_seed(ratio)
    dim, state_rows, windows = 64, 90, 7
    state = torch.randn(state_rows, 2 * overlap * dim, generator=g).to(DEVICE) * 3
    rows = torch.randint(0, state_rows, (windows, overlap * ratio), generator=g)
    rows[0, : ratio // 2] = -1  # the first window: its oldest rows lie before position 0
    rows[1] = -1
    weight = (torch.rand(dim, generator=g) + 0.5).to(DEVICE)
    ours = TritonAttention().compress_pool(state, rows.to(DEVICE), ratio, overlap, weight, 1e-6)
    reference = REFERENCE.compress_pool(state, rows.to(DEVICE), ratio, overlap, weight, 1e-6)
    assert ours.dtype == torch.float32 and ours.shape == (windows, dim)
    closing = [0, *range(2, windows)]
    assert torch.allclose(ours[closing], reference[closing], rtol=1e-4, atol=1e-5)
    assert torch.isfinite(ours[closing]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, width, ratio", [(1, 256, 4), (9, 1536, 128), (0, 64, 4)])
def test_compressor_rows_match_the_reference(tokens, width, ratio, dtype):
    """Rows written at their slots (the others untouched), widened to fp32, the position bias in the score half."""
    g = torch.Generator().manual_seed(tokens + width)
    state = torch.randn(40, 2 * width, generator=g).to(DEVICE)
    # the column slices of one fused projection's output, as the model passes them (read in place)
    kv, score = torch.randn(tokens, 2 * width + 16, generator=g).to(dtype).to(DEVICE)[:, 16:].split(width, dim=-1)
    bias = torch.randn(ratio, width, generator=g).to(DEVICE)
    positions = torch.randint(0, 4 * ratio, (tokens,), generator=g).to(DEVICE)
    slots = torch.randperm(40, generator=g)[:tokens].to(DEVICE)
    ours, reference = state.clone(), state.clone()
    TritonAttention().store_compressor_rows(ours, slots, kv, score, bias, positions)
    REFERENCE.store_compressor_rows(reference, slots, kv, score, bias, positions)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        TritonAttention().store_compressor_rows(ours, slots, kv, score, bias[:, :-1], positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rope_dim", [((5, 64), 16), ((3, 4, 512), 64), ((1, 2, 32), 32), ((0, 3, 64), 16)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_matches_the_reference(shape, rope_dim, inverse, dtype):
    """RoPE in one launch: the trailing pairs rotated in fp32, the rest copied."""
    from deepinfer.runtime.ops import rotate_pairs

    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    angles = torch.rand(shape[0], rope_dim // 2, generator=g) * 100
    phases = torch.polar(torch.ones_like(angles), angles).to(DEVICE)
    ours = TritonAttention().rotate(x, phases, rope_dim, inverse)
    reference = rotate_pairs(x, phases, rope_dim, inverse)
    assert ours.shape == x.shape and ours.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(ours, reference, **tolerance)
    assert torch.equal(ours[..., :-rope_dim], x[..., :-rope_dim])


def test_decode_splits_fill_the_sms_once_when_programs_are_few():
    """The split counts the H200 sweep chose (132 SMs, 20 key tiles of window + 512 entries, 2 head blocks)."""
    assert decode_splits(2, 20, 132) == 20  # 1 token: one-tile splits
    assert decode_splits(32, 20, 132) == 4  # 16 tokens: 128 programs, not 160
    assert decode_splits(2, 4, 132) == 4  # a window-only layer
    assert decode_splits(128, 20, 132) == 2  # 64 tokens: the previous rule (rounded up, 4+ tiles)
    assert decode_splits(200, 20, 132) == 1
    for programs in range(1, 34):
        splits = decode_splits(programs, 20, 132)
        assert 1 <= splits <= 20 and programs * splits <= 132
