"""Reference hyper-connections: the logits' projection, sigmoids and a Sinkhorn loop of small torch ops, the
streams' collapse and expansion, and V4.1's Engram gate on them (``runtime.ops``)."""

from __future__ import annotations

from deepinfer.runtime.ops import engram_gate, mhc_coefficients, mhc_collapse, mhc_expand, mhc_logits
from deepinfer.plugins.hookspecs import hookimpl


class TorchMHC:
    name = "torch-reference"
    graph_safe = True
    batch_invariant = True

    def coefficients(self, logits, hc_mult, sinkhorn_iters, eps):
        return mhc_coefficients(logits, hc_mult, sinkhorn_iters, eps)

    def weights(self, streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps):
        # through self.coefficients: a subclass that replaces only the Sinkhorn (Ascend) serves this too
        return self.coefficients(mhc_logits(streams, fn, base, scale, norm_eps), hc_mult, sinkhorn_iters, hc_eps)

    def collapse(self, streams, pre, norm_weight=None, eps=0.0):
        return mhc_collapse(streams, pre, norm_weight, eps)

    def sublayer_input(self, streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps, norm_weight=None,
                       eps=0.0):
        pre, post, comb = self.weights(streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps)
        return self.collapse(streams, pre, norm_weight, eps), post, comb

    def single_pass_input(self, streams, previous_pre, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps,
                          norm_weight=None, eps=0.0):
        pre, post, comb = self.weights(streams, fn, base, scale, hc_mult, sinkhorn_iters, hc_eps, norm_eps)
        return self.collapse(streams, previous_pre, norm_weight, eps), pre, post, comb

    def expand(self, streams, output, post, comb):
        return mhc_expand(streams, output, post, comb)

    def engram_gate(self, streams, key, value, q_weight, k_weight, eps):
        return engram_gate(streams, key, value, q_weight, k_weight, eps)


@hookimpl(trylast=True)
def deepinfer_mhc_backend(config, device):
    return TorchMHC()
