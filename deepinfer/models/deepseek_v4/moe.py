"""DeepSeek-V4 MoE: router (hash or score top-k with correction bias), routed experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.core.linear import ExpertStack, Linear
from deepinfer.core.ops import swiglu
from deepinfer.plugins.interfaces import ExpertWeights, MoEBackend


_SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


class MoE(nn.Module):
    # set by ``ExpertParallel.attach`` when the routed experts are spread over ranks
    expert_parallel = None
    layer_index = 0

    def __init__(self, config, is_hash: bool, backend: MoEBackend):
        super().__init__()
        hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
        self.backend = backend
        self.is_hash = is_hash
        self.top_k = config.num_experts_per_tok
        self.score = _SCORE_FUNCTIONS[config.scoring_func]
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.limit = config.swiglu_limit
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(experts, hidden), requires_grad=False)
        if is_hash:
            self.gate.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.gate.register_buffer("bias", torch.zeros(experts, dtype=torch.float32))
        self.experts = nn.Module()
        self.experts.w1 = ExpertStack(experts, inter, hidden)
        self.experts.w3 = ExpertStack(experts, inter, hidden)
        self.experts.w2 = ExpertStack(experts, hidden, inter)
        shared_inter = inter * config.n_shared_experts
        self.shared_experts = nn.Module()
        self.shared_experts.w1 = Linear(hidden, shared_inter)
        self.shared_experts.w3 = Linear(hidden, shared_inter)
        self.shared_experts.w2 = Linear(shared_inter, hidden)
        self.activation_block = config.weight_block_size[1]

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(x.float() @ self.gate.weight.float().T)
        if self.is_hash:
            ids = self.gate.tid2eid[token_ids].long()
        else:
            # sorted: the slots' order sets the order their outputs are summed in, and an unsorted top-k's order is
            # whatever its algorithm, chosen by the tensor's size, leaves
            ids = torch.topk(scores + self.gate.bias, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.route_scale

    def hold_experts(self, count: int) -> None:
        """Expert parallelism: this process keeps ``count`` expert slots (built on ``meta``, before loading)."""
        for stack in (self.experts.w1, self.experts.w3, self.experts.w2):
            stack.weight = nn.Parameter(stack.weight.new_empty(count, *stack.weight.shape[1:]), requires_grad=False)

    def expert_tensors(self, name: str) -> list[torch.Tensor]:
        """One stack's per-expert tensors (weight, and scale when quantized), each [slots, ...]."""
        stack = getattr(self.experts, name)
        return [stack.weight] if stack.scale is None else [stack.weight, stack.scale]

    def _expert_weights(self) -> ExpertWeights:
        w1, w3, w2 = self.experts.w1, self.experts.w3, self.experts.w2
        return ExpertWeights(w1.weight, w3.weight, w2.weight, self.limit, w1.scale, w3.scale, w2.scale,
                             self.activation_block)

    def idle_exchange(self, dtype: torch.dtype) -> None:
        """Expert parallelism, a rank without tokens: its experts still compute the other ranks' tokens."""
        hidden = self.gate.weight.shape[1]
        device = self.gate.weight.device
        self.expert_parallel.routed_experts(
            self.layer_index, torch.empty(0, hidden, dtype=dtype, device=device),
            torch.empty(0, self.top_k, dtype=torch.int64, device=device),
            torch.empty(0, self.top_k, device=device), self._expert_weights(), self.backend)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x, token_ids)
        if self.expert_parallel is None:
            routed = self.backend.routed_experts(x, ids, weights, self._expert_weights())
        else:
            routed = self.expert_parallel.routed_experts(self.layer_index, x, ids, weights, self._expert_weights(),
                                                         self.backend)
        shared = self.shared_experts
        hidden = swiglu(shared.w1(x), shared.w3(x), self.limit)
        return routed + shared.w2(hidden.to(x.dtype))
