"""Reference MoE backend: routing as ``runtime.ops.route_tokens``; loops over the experts that received tokens."""

from __future__ import annotations

import torch

from deepinfer.runtime.ops import project, route_tokens, swiglu
from deepinfer.plugins.hookspecs import hookimpl


def _scale(scales: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if scales is None else scales[expert]


class TorchMoE:
    name = "torch-reference"
    graph_safe = False  # loops over the experts that received tokens, which the host must know
    batch_invariant = True  # a token's experts are summed in expert order, whoever else was routed there

    def route(self, x, token_ids, router):
        return route_tokens(x, token_ids, router)

    def swiglu(self, gate, up, limit):
        return swiglu(gate, up, limit).to(gate.dtype)

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        block = weights.activation_block
        for expert in topk_ids.unique().tolist():
            tokens, slots = torch.where(topk_ids == expert)
            rows = x[tokens]
            gate = project(rows, weights.w1[expert], _scale(weights.w1_scale, expert), block)
            up = project(rows, weights.w3[expert], _scale(weights.w3_scale, expert), block)
            h = project(swiglu(gate, up, weights.swiglu_limit), weights.w2[expert], _scale(weights.w2_scale, expert), block)
            out.index_add_(0, tokens, h * topk_weights[tokens, slots].unsqueeze(-1))
        return out.to(x.dtype)


@hookimpl(trylast=True)
def deepinfer_moe_backend(config, device):
    return TorchMoE()
