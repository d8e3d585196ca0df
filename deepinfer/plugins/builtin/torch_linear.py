"""Reference GEMM over quantized weights: dequantizes a slab of rows at a time (``blockwise_linear``), or the whole
weight for a grouped projection (``grouped_dequantized_linear``); fp32 logits
from a narrower head, upcast a slab of rows at a time (``fp32_logits``)."""

from __future__ import annotations

from deepinfer.runtime.ops import fp32_logits, grouped_dequantized_linear
from deepinfer.runtime.quantization import blockwise_linear
from deepinfer.plugins.hookspecs import hookimpl


class TorchLinear:
    name = "torch-reference"
    graph_safe = True
    batch_invariant = True

    def linear(self, x, weight, scale, activation_block):
        return blockwise_linear(x, weight, scale, activation_block)

    def grouped_linear(self, x, weight, scale):
        return grouped_dequantized_linear(x, weight, scale)

    def logits(self, hidden, weight):
        return fp32_logits(hidden, weight)


@hookimpl(trylast=True)
def deepinfer_linear_backend(config, device):
    return TorchLinear()
