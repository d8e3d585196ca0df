"""The reference attention with a fixed reduction structure: keys in blocks of a fixed size, folded in order.

A query's index list is as wide as the widest one in its step (-1 padded), and torch's softmax and batched
products reduce a row in an order that depends on its width: measured on CPU, one query's output changes when 7
padded keys are appended. Here every product and sum covers one block of ``KEY_BLOCK`` keys, and blocks are folded
into a running (max, denominator, output) one after another, starting from the sink. A block of padding leaves the
running state bit-identical (its weights are exact zeros and the rescale factor is exactly 1), so padding to any
width gives the same bits.
"""

from __future__ import annotations

import torch

from deepinfer.plugins.builtin.torch_attention import TorchAttention

KEY_BLOCK = 64


def _blocks(width: int):
    for start in range(0, width, KEY_BLOCK):
        yield start, min(start + KEY_BLOCK, width)


def _padded(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` [T, K] padded with -1 to whole blocks, so every block has ``KEY_BLOCK`` keys."""
    padding = (-indices.shape[1]) % KEY_BLOCK
    return torch.nn.functional.pad(indices, (0, padding), value=-1) if padding else indices


class BlockedTorchAttention(TorchAttention):
    name = "torch-reference, fixed key blocks (batch-invariant)"
    batch_invariant = True

    def sparse_attention(self, q, sources, sinks, scale):
        num_tokens, num_heads, _ = q.shape
        queries = q.float()
        # the sink is the first element of every softmax: max = sink, denominator = exp(0) = 1, no value
        running_max = sinks.float().view(1, num_heads, 1).expand(num_tokens, -1, -1).contiguous()
        denominator = torch.ones_like(running_max)
        out = torch.zeros_like(queries)
        for pool, indices in sources:
            indices = _padded(indices)
            for start, end in _blocks(indices.shape[1]):
                block = indices[:, start:end]
                keys = pool[block.clamp(min=0)].float()
                scores = torch.einsum("thd,tkd->thk", queries, keys) * scale
                scores = scores.masked_fill((block < 0).unsqueeze(1), float("-inf"))
                new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
                rescale = torch.exp(running_max - new_max)
                weights = torch.exp(scores - new_max)
                denominator = denominator * rescale + weights.sum(dim=-1, keepdim=True)
                out = out * rescale + torch.einsum("thk,tkd->thd", weights, keys)
                running_max = new_max
        return (out / denominator).to(q.dtype)

    def indexer_scores(self, q, weights, keys, candidates):
        width = candidates.shape[1]
        if width == 0:
            return torch.empty(candidates.shape, dtype=torch.float32, device=q.device)
        padded = _padded(candidates)
        head_weights = weights.float().unsqueeze(-1)
        scores = []
        for start, end in _blocks(padded.shape[1]):
            block = padded[:, start:end]
            dots = torch.einsum("thd,tcd->thc", q.float(), keys[block.clamp(min=0)].float()).relu()
            scores.append((dots * head_weights).sum(dim=1).masked_fill(block < 0, float("-inf")))
        return torch.cat(scores, dim=1)[:, :width]
