"""Routed experts on torch_npu: routing, two grouped matmuls and a clipped SwiGLU; the weighted sum in torch.

Per call: ``npu_moe_init_routing_v2`` puts every (token, slot) row in expert order and counts each expert's rows;
``npu_grouped_matmul`` multiplies them by the fused w1|w3 weights; ``npu_clipped_swiglu`` applies the clamped
SwiGLU in fp32; a second ``npu_grouped_matmul`` applies w2; torch adds each token's rows back, weighted, in expert
order. Shapes depend only on the inputs' (dropless routing), so nothing waits on the device.

Where it differs from the reference (``TorchMoE``), by design:

* gate/up and w2 outputs are rounded to the activations' dtype (bf16 for the released models): the operator has
  no fp32 output for bf16 inputs. Quantized experts' products are exact (see ``layouts.grouped_weight``).
* FP8/MXFP4 experts are kept dequantized in that dtype, converted on first use (and again if changed in place):
  2x the FP8 bytes, 4x the MXFP4 bytes. The documented grouped matmul has no FP8/MXFP4 weight path for the 950;
  until one is, a full V4-Flash does not fit this way.
* Activations are rounded to FP8 by ``round_fp8`` in torch, not ``npu_dynamic_quant``: that operator's scales are
  per token over 127 (int8), not the power-of-two per-block scales the checkpoints' kernels use.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.runtime.ops import route_tokens
from deepinfer.logger import init_logger, log_once
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_ascend.layouts import (activation, clipped_swiglu_arguments, combine, compute_dtype,
                                      grouped_matmul_arguments, grouped_weight, init_routing_arguments)

logger = init_logger(__name__)


class _Converted:
    """One MoE layer's experts in grouped-matmul layout: fused w1|w3 [E, hidden, 2I] and w2 [E, I, hidden]."""

    def __init__(self, weights: ExpertWeights, dtype: torch.dtype):
        self.key = _key(weights, dtype)
        gate = grouped_weight(weights.w1, weights.w1_scale, dtype)
        up = grouped_weight(weights.w3, weights.w3_scale, dtype)
        self.gate_up = torch.cat([gate, up], dim=2)
        self.down = grouped_weight(weights.w2, weights.w2_scale, dtype)


def _key(weights: ExpertWeights, dtype: torch.dtype) -> tuple:
    # _version changes with every in-place write (expert rebalancing copies experts into their slots)
    tensors = [t for t in (weights.w1, weights.w3, weights.w2, weights.w1_scale, weights.w3_scale, weights.w2_scale)
               if t is not None]
    return (dtype, *((t.data_ptr(), t._version) for t in tensors))


class AscendMoE:
    """``MoEBackend`` on torch_npu; ``ops`` is the torch_npu module."""

    name = "ascend-grouped-matmul"
    graph_safe = True
    batch_invariant = False  # the grouped matmul's tiling may follow the rows per expert: not established

    def __init__(self, ops):
        self.ops = ops
        self.reference = TorchMoE()
        self._converted: dict[int, _Converted] = {}  # by w1's storage

    def route(self, x, token_ids, router):
        # torch on the NPU: npu_moe_gating_top_k has no sqrt-softplus scoring (V4 uses it; see the README)
        return route_tokens(x, token_ids, router)

    def swiglu(self, gate, up, limit):
        return self.reference.swiglu(gate, up, limit)

    def routed_experts(self, x, topk_ids, topk_weights, weights):
        reason = _unsupported(weights)
        if reason is not None:
            log_once(logger, logging.WARNING, f"Ascend MoE: {reason}; the torch reference serves these experts")
            return self.reference.routed_experts(x, topk_ids, topk_weights, weights)
        if topk_ids.shape[0] == 0:
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        dtype = compute_dtype(x)
        experts = self._experts(weights, dtype)
        block = weights.activation_block
        args, kwargs = init_routing_arguments(activation(x, weights.w1_scale, block, dtype), topk_ids,
                                              experts.gate_up.shape[0])
        rows, row_of_slot, counts, _ = self.ops.npu_moe_init_routing_v2(*args, **kwargs)
        args, kwargs = grouped_matmul_arguments(rows, experts.gate_up, counts)
        gate_up = self.ops.npu_grouped_matmul(*args, **kwargs)[0]
        args, kwargs = clipped_swiglu_arguments(gate_up, weights.swiglu_limit)
        hidden = self.ops.npu_clipped_swiglu(*args, **kwargs)
        args, kwargs = grouped_matmul_arguments(activation(hidden, weights.w2_scale, block, dtype), experts.down, counts)
        out = self.ops.npu_grouped_matmul(*args, **kwargs)[0]
        return combine(out, row_of_slot, topk_ids, topk_weights).to(x.dtype)

    def _experts(self, weights: ExpertWeights, dtype: torch.dtype) -> _Converted:
        slot = weights.w1.data_ptr()
        cached = self._converted.get(slot)
        if cached is None or cached.key != _key(weights, dtype):
            if weights.w1_scale is not None and cached is None:
                log_once(logger, logging.INFO, f"Ascend MoE: quantized experts are dequantized to {dtype} once per "
                                               "layer (no documented FP8/MXFP4 grouped matmul on the 950)")
            cached = self._converted[slot] = _Converted(weights, dtype)
        return cached


def _unsupported(weights: ExpertWeights) -> str | None:
    if (weights.w1_scale is None) != (weights.w3_scale is None):
        return "w1 and w3 are not both quantized or both float (their fused product needs one input rounding)"
    if weights.w1.shape[0] == 1:
        return "one expert (npu_grouped_matmul takes per-group sizes only for more than one group)"
    return None
