"""Reference hyper-connection weights: sigmoids and a Sinkhorn loop of small torch ops (``core.ops``)."""

from __future__ import annotations

from deepinfer.core.ops import mhc_coefficients
from deepinfer.plugins.hookspecs import hookimpl


class TorchMHC:
    name = "torch-reference"
    graph_safe = True

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        return mhc_coefficients(logits, hc_mult, sinkhorn_iters, eps)


@hookimpl(trylast=True)
def deepinfer_mhc_backend(config, device):
    return TorchMHC()
