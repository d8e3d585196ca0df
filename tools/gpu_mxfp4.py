"""MXFP4 routed experts on the GPU: each decode strategy of ``deepinfer_nvidia.moe`` checked against the torch
reference and timed at V4.1-Flash shapes (hidden 5120, intermediate 2304, top-6 of 384 experts), printed as JSON.

    PYTHONPATH=$PWD:$PWD/backends/nvidia python tools/gpu_mxfp4.py

The kernel decodes e2m1 codes into fp16 by bit placement and runs two K=16 MMAs per 32-column block, rescaling the
accumulator per block; ``moe.PACKED_E2M1_DECODE`` picks how the codes are decoded: int16 ops per value (``int16``)
or two values at a time with packed 32-bit ops in inline PTX (``packed``, the default). Each call is captured in a
CUDA graph and its replays timed (median of do_bench, L2 flushed); GB/s counts the bytes of the experts the routing
touches (packed weights and their scales), each once.
"""

from __future__ import annotations

import json

import torch

from deepinfer.core.quantization import quantize_fp4
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia import moe as moe_module
from gpu_kernels import _graph_us  # tools/: a call captured in a CUDA graph, its replays timed

DEVICE = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6
CASES = {"batch 1": (1, TOP_K), "batch 16": (16, TOP_K), "batch 64": (64, TOP_K), "prefill 2048": (2048, TOP_K)}


def _stack(rows: int, cols: int):
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=DEVICE) * cols**-0.5)
                           for _ in range(EXPERTS)))
    return torch.stack(packed), torch.stack(scales)


def main() -> dict:
    torch.manual_seed(0)
    (w1, s1), (w3, s3), (w2, s2) = _stack(INTER, HIDDEN), _stack(INTER, HIDDEN), _stack(HIDDEN, INTER)
    weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128)
    per_expert = sum(t[0].numel() * t.element_size() for t in (w1, w3, w2, s1, s3, s2))
    moe, reference = moe_module.TritonMoE(reference=None), TorchMoE()
    rows = []
    for name, (tokens, top_k) in CASES.items():
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.rand(tokens, EXPERTS, device=DEVICE).argsort(1)[:, :top_k]
        topk_weights = torch.rand(tokens, top_k, device=DEVICE)
        expected = reference.routed_experts(x, ids, topk_weights, weights).float()
        touched = int(ids.unique().numel()) * per_expert
        row = {"case": name, "tokens": tokens, "experts_touched": touched // per_expert, "GB": round(touched / 1e9, 3)}
        for strategy, packed in (("int16", False), ("packed", True)):
            moe_module.PACKED_E2M1_DECODE = packed
            try:
                got = moe.routed_experts(x, ids, topk_weights, weights).float()
                err = float((got - expected).abs().max() / expected.abs().max())
                us = _graph_us(lambda: moe.routed_experts(x, ids, topk_weights, weights))
                row[strategy] = {"us": round(us, 1), "GBps": round(touched / us / 1e3), "max_err_rel": round(err, 5)}
            except Exception as exc:  # noqa: BLE001 (a failing strategy is recorded, the others still run)
                row[strategy] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    moe_module.PACKED_E2M1_DECODE = True
    return {"device": torch.cuda.get_device_name(), "rows": rows}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
