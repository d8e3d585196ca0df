"""Hyper-connections on torch_npu's mHC operators (Ascend 950 only): ``npu_mhc_sinkhorn`` for the residual mixing
matrix, ``npu_mhc_post`` for the expansion; the sigmoids and the collapse stay the reference's.

``npu_mhc_pre`` is not used: it starts from the streams and the projection weights (it fuses the projection and
norm that the model runs before this hook), not from the logits ``coefficients`` receives. Calls outside the
operators' documented range (n not 4/6/8, fp32 streams) go to the reference, logged once.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins.builtin.torch_mhc import TorchMHC
from deepinfer_ascend.layouts import (MHC_POST_DTYPES, SINKHORN_MAX_ITERS, SINKHORN_N, SINKHORN_ROWS,
                                      mhc_post_arguments, sinkhorn_arguments)

logger = init_logger(__name__)


class AscendMHC(TorchMHC):
    """``MHCBackend`` with Sinkhorn and expansion on torch_npu; ``ops`` is the torch_npu module."""

    name = "ascend-mhc"
    graph_safe = True
    batch_invariant = False  # not established for the operators

    def __init__(self, ops):
        self.ops = ops

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        n = hc_mult
        if n not in SINKHORN_N or not 1 <= sinkhorn_iters <= SINKHORN_MAX_ITERS:
            log_once(logger, logging.INFO, f"Ascend mHC: n={n}, {sinkhorn_iters} Sinkhorn iterations are outside "
                                           "npu_mhc_sinkhorn's range; the torch reference serves them")
            return super().coefficients(logits, hc_mult, sinkhorn_iters, eps)
        pre = torch.sigmoid(logits[:, :n]) + eps
        post = 2 * torch.sigmoid(logits[:, n:2 * n])
        comb_logits = logits[:, 2 * n:].unflatten(-1, (n, n))
        comb = torch.empty_like(comb_logits, dtype=torch.float32)
        for start in range(0, logits.shape[0], SINKHORN_ROWS):
            rows = slice(start, start + SINKHORN_ROWS)
            args, kwargs = sinkhorn_arguments(comb_logits[rows], sinkhorn_iters, eps)
            comb[rows] = self.ops.npu_mhc_sinkhorn(*args, **kwargs)[0]
        return pre, post, comb

    def expand(self, streams, output, post, comb):
        if streams.dtype not in MHC_POST_DTYPES or output.dtype != streams.dtype:
            log_once(logger, logging.INFO, f"Ascend mHC: streams in {streams.dtype}, outputs in {output.dtype} "
                                           "(npu_mhc_post takes bf16/fp16, both alike); the torch reference serves them")
            return super().expand(streams, output, post, comb)
        args, kwargs = mhc_post_arguments(streams, output, post, comb)
        return self.ops.npu_mhc_post(*args, **kwargs)
