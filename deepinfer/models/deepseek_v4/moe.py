"""DeepSeek-V4 MoE: router (hash or score top-k with correction bias), routed experts, shared expert. The MoE
backend routes (``MoEBackend.route``) and runs the routed experts."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from deepinfer.runtime.linear import ExpertStack, Linear, SharedInput
from deepinfer.plugins.interfaces import ExpertWeights, MoEBackend, RouterWeights


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
        self.scoring_func = config.scoring_func
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
        self.shared_input = SharedInput({"gate": self.shared_experts.w1, "up": self.shared_experts.w3})
        self.activation_block = config.weight_block_size[1]

    @property
    def router(self) -> RouterWeights:
        # built per call, not kept: moving the module to a device replaces its buffers (bias, tid2eid)
        gate = self.gate
        return RouterWeights(gate.weight, None if self.is_hash else gate.bias, gate.tid2eid if self.is_hash else None,
                             self.top_k, self.scoring_func, self.norm_topk_prob, self.route_scale)

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.route(x, token_ids, self.router)

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

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``image_mask`` [T] bool (a vision model's image tokens): those rows pick their experts by score +
        ``gate.bias_vl`` (never by hash), as the release routes them; every row is routed both ways and the right
        one kept, so any routing backend serves and the step needs no host sync."""
        ids, weights = self.route(x, token_ids)
        if image_mask is not None:
            vision = dataclasses.replace(self.router, bias=self.gate.bias_vl, tid2eid=None)
            image_ids, image_weights = self.backend.route(x, token_ids, vision)
            ids = torch.where(image_mask[:, None], image_ids, ids)
            weights = torch.where(image_mask[:, None], image_weights, weights)
        if self.expert_parallel is None:
            routed = self.backend.routed_experts(x, ids, weights, self._expert_weights())
        else:
            routed = self.expert_parallel.routed_experts(self.layer_index, x, ids, weights, self._expert_weights(),
                                                         self.backend)
        projected = self.shared_input(x)
        return routed + self.shared_experts.w2(self.backend.swiglu(projected["gate"], projected["up"], self.limit))
