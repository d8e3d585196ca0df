"""The NVIDIA attention backend: ``TritonAttention`` sends each sparse attention call to FlashMLA where build.sh
provisioned it and the call fits its kernels (its sparse decode over FP8 pools, its sparse prefill for calls of many
tokens over bf16 pools), to the Triton kernels of ``sparse_attention.py`` otherwise, and serves the layer's other
attention ops (cache writes, RoPE, norms, the compressor, the indexer) with the plugin's kernels."""

from __future__ import annotations

import torch

from deepinfer.runtime import fp8_kv
from deepinfer.runtime.ops import select_topk
from deepinfer_nvidia.cache_formats import round_to_format
from deepinfer_nvidia.compress_pool import compress_pool, store_compressor_rows
from deepinfer_nvidia.dependent_launch import LAUNCH
from deepinfer_nvidia.kv_store import store_rows
from deepinfer_nvidia.norm import rms_norm
from deepinfer_nvidia.rope import rotate
from deepinfer_nvidia.slots import padded_slots
from deepinfer_nvidia.sparse_attention import _merge_normalized_kernel, _unit_rows, indexer_scores, sparse_attention


def _flashmla_serves(q, sources) -> bool:
    """FlashMLA's sparse decode takes FP8 pools in its layout, one or two of them, and 64 or 128 heads of 512."""
    return (len(sources) <= 2 and q.shape[1] in (64, 128) and q.shape[2] == fp8_kv.WIDTH
            and all(isinstance(pool, fp8_kv.FP8Rows) for pool, _ in sources))


def _flashmla_attention(sparse_decode, q, sources, sinks, scale):
    """Each token is a batch entry with one query; index lists are padded with -1 to whole 64-key blocks."""
    def indices(idx):
        padded = torch.nn.functional.pad(idx, (0, -idx.shape[1] % 64), value=-1)
        return padded.to(torch.int32).unsqueeze(1)

    (main, main_idx), extra = sources[-1], sources[0] if len(sources) == 2 else None
    out = sparse_decode(q.unsqueeze(1), main.flashmla_view(), indices(main_idx), sinks.float(), scale,
                        extra[0].flashmla_view() if extra else None, indices(extra[1]) if extra else None)
    return out.squeeze(1)


# FlashMLA's sparse prefill is 5.8-6.3x faster than the Triton kernel at 512-4096 tokens (H200, V4-Flash shapes);
# decode steps (fewer tokens) keep the Triton kernel, whose times there are the ones measured against FlashMLA's decode
FLASHMLA_PREFILL_MIN_TOKENS = 256


def _flashmla_prefill_serves(q, sources) -> bool:
    """FlashMLA's sparse prefill takes bf16 queries and rows, 64 or 128 heads of 512; two sources at most here."""
    return (q.shape[0] >= FLASHMLA_PREFILL_MIN_TOKENS and len(sources) <= 2 and q.dtype == torch.bfloat16
            and q.shape[1] in (64, 128) and q.shape[2] == fp8_kv.WIDTH
            and all(isinstance(pool, torch.Tensor) and pool.dtype == torch.bfloat16 for pool, _ in sources))


def _flashmla_prefill_attention(sparse_prefill, q, sources, sinks, scale):
    """One FlashMLA call per source (its kernel reads one pool): a lone source applies the sinks itself, two are
    merged by their log-sum-exps. Index lists are padded with -1 to whole 128-key blocks."""
    q = _unit_rows(q)

    def call(pool, idx, sink):
        padded = torch.nn.functional.pad(idx, (0, -idx.shape[1] % 128), value=-1).to(torch.int32).unsqueeze(1)
        return sparse_prefill(q, _unit_rows(pool).unsqueeze(1), padded, scale, sink)

    if len(sources) == 1:
        return call(*sources[0], sinks.float())[0]
    (a, lse_a), (b, lse_b) = (call(pool, idx, None) for pool, idx in sources)
    out = torch.empty_like(q)
    _merge_normalized_kernel[(q.shape[0], q.shape[1])](
        a, a.stride(0), a.stride(1), lse_a, lse_a.stride(0), b, b.stride(0), b.stride(1), lse_b, lse_b.stride(0),
        sinks, out, out.stride(0), out.stride(1), D=q.shape[2], **LAUNCH)
    return out


class TritonAttention:
    """Triton kernels for every call; FlashMLA where build.sh provisioned it: its sparse decode for the calls over FP8
    pools, its sparse prefill for calls of many tokens over bf16 pools (64 or 128 heads of 512 either way)."""

    name = "triton"
    graph_safe = True

    def __init__(self, flash_mla=None, tiles_per_split: int | None = None, flash_mla_prefill=None):
        self.flash_mla = flash_mla  # deepseek_kernels.flash_mla()'s function, or None
        self.flash_mla_prefill = flash_mla_prefill  # deepseek_kernels.flash_mla_prefill()'s function, or None
        self.tiles_per_split = tiles_per_split  # fixed split size (batch-invariant mode), or None
        self.batch_invariant = tiles_per_split is not None and flash_mla is None and flash_mla_prefill is None
        if tiles_per_split is not None:
            self.name = f"triton, {tiles_per_split} key tiles per split (batch-invariant)"

    def sparse_attention(self, q, sources, sinks, scale):
        if self.flash_mla is not None and q.shape[0] and _flashmla_serves(q, sources):
            return _flashmla_attention(self.flash_mla, q, sources, sinks, scale)
        if self.flash_mla_prefill is not None and _flashmla_prefill_serves(q, sources):
            return _flashmla_prefill_attention(self.flash_mla_prefill, q, sources, sinks, scale)
        return sparse_attention(q, sources, sinks, scale, tiles_per_split=self.tiles_per_split)

    def store_rows(self, pool, slots, rows):
        store_rows(pool, slots, rows)

    def store_compressor_rows(self, state, slots, kv, score, position_bias, positions):
        store_compressor_rows(state, slots, kv, score, position_bias, positions)

    def rotate(self, x, phases, rope_dim, inverse=False):
        return rotate(x, phases, rope_dim, inverse)

    def round_to_format(self, x, fmt):
        return round_to_format(x, fmt)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def padded_slots(self, layout, inputs):
        return padded_slots(layout, inputs)

    def compress_pool(self, state, rows, ratio, overlap, norm_weight, eps):
        return compress_pool(state, rows, ratio, overlap, norm_weight, eps)

    def indexer_scores(self, q, weights, keys, candidates):
        return indexer_scores(q, weights, keys, candidates)

    def indexer_topk(self, q, weights, keys, candidates, topk):
        return select_topk(self.indexer_scores(q, weights, keys, candidates), candidates, topk)
