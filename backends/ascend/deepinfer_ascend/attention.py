"""Sparse MQA with sinks on ``torch_npu.npu_sparse_flash_attention``; the rest of the attention backend is the
reference's (plain torch, which runs on the NPU as on any device).

The operator serves V4's layout: one 512-wide KV row per key, used as key and value (``attention_mode=2``, the
RoPE inputs zero), token-wise index lists, sinks in the softmax denominator (the ``sinks`` argument, Ascend 950
only: A2/A3 reject it). Calls it cannot take (other head widths or dtypes, more than 128 heads: the tiny test
models) go to the reference, logged once. See ``layouts.sfa_arguments`` for the argument mapping.

Not served here, and why:

* ``indexer_topk``/``indexer_scores``: ``npu_lightning_indexer`` selects over a causal range of one key sequence,
  while the hook scores arbitrary candidate lists and must break ties as ``select_topk`` does; it returns no
  scores outside training (``return_value``).
* ``rotate``: ``npu_interleave_rope`` reads interleaved pairs but writes the rotated channels in half-split order,
  while the hook keeps them interleaved (and its doc lists A2/A3 only).
* ``compress_pool``, ``store_rows``: no operator found for V4's overlapping softmax pooling or its FP8 row layout.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer_ascend.layouts import sfa_arguments, sfa_pieces, sfa_unsupported

logger = init_logger(__name__)


class AscendAttention(TorchAttention):
    """``AttentionBackend`` whose ``sparse_attention`` runs on torch_npu; ``ops`` is the torch_npu module."""

    name = "ascend-sparse-flash-attention"
    graph_safe = True  # the pieces depend on shapes only
    batch_invariant = False  # the operator's reduction tiling is not documented

    def __init__(self, ops):
        self.ops = ops

    def sparse_attention(self, q, sources, sinks, scale):
        reason = sfa_unsupported(q, sources)
        if reason is not None:
            log_once(logger, logging.INFO, f"Ascend attention: {reason}; the torch reference serves it")
            return super().sparse_attention(q, sources, sinks, scale)
        out = torch.empty_like(q)
        for rows, keys, indices in sfa_pieces(q, sources):
            args, kwargs = sfa_arguments(q[rows], keys, indices, sinks, scale)
            out[rows] = self.ops.npu_sparse_flash_attention(*args, **kwargs)[0]
        return out
