"""Reference routed-experts backend: loops over the experts that received tokens."""

from __future__ import annotations

import torch

from deepinfer.core.ops import swiglu
from deepinfer.plugins.hookspecs import hookimpl


class TorchMoE:
    name = "torch-reference"

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in topk_ids.unique().tolist():
            tokens, slots = torch.where(topk_ids == expert)
            h = swiglu(x[tokens], weights.w1[expert], weights.w3[expert], weights.w2[expert], weights.swiglu_limit)
            out.index_add_(0, tokens, h * topk_weights[tokens, slots].unsqueeze(-1))
        return out.to(x.dtype)


@hookimpl(trylast=True)
def deepinfer_moe_backend(config, device):
    return TorchMoE()
