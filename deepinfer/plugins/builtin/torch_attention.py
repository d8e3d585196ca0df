"""Reference attention backend in plain torch: runs on any device, favours clarity over speed."""

from __future__ import annotations

import torch

from deepinfer.runtime import fp8_kv
from deepinfer.runtime.cache_formats import round_to_format
from deepinfer.runtime.ops import compress_pool, compressor_rows, rms_norm, rotate_pairs, select_topk
from deepinfer.runtime.slots import padded_slots
from deepinfer.plugins.hookspecs import hookimpl

# Queries per chunk are chosen so one chunk's gathered keys stay near this many elements.
_GATHER_BUDGET = 1 << 24


def _query_chunks(num_tokens: int, keys_per_query: int, dim: int):
    step = max(1, _GATHER_BUDGET // max(1, keys_per_query * dim))
    for start in range(0, num_tokens, step):
        yield slice(start, min(start + step, num_tokens))


class TorchAttention:
    name = "torch-reference"
    graph_safe = True
    batch_invariant = False  # reduces over the padded width; features/batch_invariant serves a blocked variant

    def store_rows(self, pool, slots, rows):
        fp8_kv.store(pool, slots, rows)

    def round_to_format(self, x, fmt):
        return round_to_format(x, fmt)

    def compress_pool(self, state, rows, ratio, overlap, norm_weight, eps):
        return compress_pool(state, rows, ratio, overlap, norm_weight, eps)

    def store_compressor_rows(self, state, slots, kv, score, position_bias, positions):
        state.index_copy_(0, slots, compressor_rows(kv, score, position_bias, positions))

    def rotate(self, x, phases, rope_dim, inverse=False):
        return rotate_pairs(x, phases, rope_dim, inverse)

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def padded_slots(self, layout, inputs):
        return padded_slots(layout, inputs)

    def sparse_attention(self, q, sources, sinks, scale):
        num_tokens, num_heads, dim = q.shape
        out = torch.empty_like(q)
        width = sum(idx.shape[1] for _, idx in sources)
        for rows in _query_chunks(num_tokens, width, dim):
            indices = torch.cat([idx[rows] for _, idx in sources], dim=1)
            keys = torch.cat([pool[idx[rows].clamp(min=0)] for pool, idx in sources], dim=1).float()
            scores = torch.einsum("thd,tkd->thk", q[rows].float(), keys) * scale
            scores = scores.masked_fill((indices < 0).unsqueeze(1), float("-inf"))
            sink = sinks.float().view(1, num_heads, 1).expand(scores.shape[0], -1, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
            out[rows] = torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
        return out

    def indexer_scores(self, q, weights, keys, candidates):
        scores = torch.empty(candidates.shape, dtype=torch.float32, device=q.device)
        for rows in _query_chunks(q.shape[0], candidates.shape[1], q.shape[1] * q.shape[2]):
            cand = candidates[rows]
            dots = torch.einsum("thd,tcd->thc", q[rows].float(), keys[cand.clamp(min=0)].float()).relu()
            scores[rows] = (dots * weights[rows].float().unsqueeze(-1)).sum(dim=1).masked_fill(cand < 0, float("-inf"))
        return scores

    def indexer_topk(self, q, weights, keys, candidates, topk):
        return select_topk(self.indexer_scores(q, weights, keys, candidates), candidates, topk)


@hookimpl(trylast=True)
def deepinfer_attention_backend(config, device):
    return TorchAttention()
