"""Kernel-level figures of the NVIDIA backend at DeepSeek-V4-Flash shapes (issue 6), printed as JSON.

    PYTHONPATH=$PWD:$PWD/backends/nvidia python tools/gpu_kernels.py

- Sparse attention, decode: 64 heads x 512, a 128-row window plus 512 indexer-selected compressed entries per
  token, bf16 pools; batch 1, 16, 128 (FlashMLA's H200 time at 128 is 51.8 µs, kernel-anchors §1), with the
  bytes each call gathers and the rate that implies.
- Routed experts: 32 experts x 16 tokens each, hidden 4096, intermediate 2048 (V4-Flash), w1/w3/w2 streamed once:
  bf16 and MXFP4 weights, GB/s of weight bytes (DeepGEMM's masked FP8 grouped GEMM streams 3.59 TB/s there).
- Routed experts in a prefill: 8192 tokens, top-6 of 256 bf16 experts, 16-row against 64-row blocks.
Inputs are fresh random values. Each call is captured in a CUDA graph and its replays timed (median of
triton.testing.do_bench, L2 flushed between runs), so host launch overhead is not counted, as in the engine.
"""

from __future__ import annotations

import json

import torch
import triton.testing

from deepinfer_nvidia import moe as moe_module
from deepinfer.core.quantization import quantize_fp4
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia.moe import TritonMoE
from deepinfer_nvidia.sparse_attention import TritonAttention

DEVICE = torch.device("cuda")


def _graph_us(fn) -> float:
    fn()  # compile and tune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay) * 1e3


def attention() -> list[dict]:
    rows = []
    heads, dim, window, selected, pool_rows = 64, 512, 128, 512, 1 << 16
    backend = TritonAttention()
    for batch in (1, 16, 128):
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=DEVICE)
        swa = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
        comp = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
        window_idx = torch.randint(0, pool_rows, (batch, window), device=DEVICE)
        comp_idx = torch.randint(0, pool_rows, (batch, selected), device=DEVICE)
        sinks = torch.randn(heads, device=DEVICE)
        sources = [(swa, window_idx), (comp, comp_idx)]
        us = _graph_us(lambda: backend.sparse_attention(q, sources, sinks, dim**-0.5))
        gathered = batch * (window + selected) * dim * 2
        flops = 2 * 2 * batch * heads * (window + selected) * dim
        rows.append({"batch": batch, "us": round(us, 1), "gathered_GBps": round(gathered / us / 1e3),
                     "TFLOPS": round(flops / us / 1e6, 1), "flashmla_h200_us_at_128": 51.8 if batch == 128 else None})
    return rows


def _stack(experts, rows, cols, fp4):
    if not fp4:
        return torch.randn(experts, rows, cols, device=DEVICE, dtype=torch.bfloat16) * cols**-0.5, None
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=DEVICE) * cols**-0.5) for _ in range(experts)))
    return torch.stack(packed), torch.stack(scales)


def experts() -> list[dict]:
    rows = []
    num, per_expert, hidden, inter = 32, 16, 4096, 2048
    moe = TritonMoE(reference=None)
    for fmt in ("bf16", "mxfp4"):
        fp4 = fmt == "mxfp4"
        (w1, s1), (w3, s3), (w2, s2) = (_stack(num, inter, hidden, fp4), _stack(num, inter, hidden, fp4),
                                        _stack(num, hidden, inter, fp4))
        weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128 if fp4 else 0)
        tokens = num * per_expert
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.arange(tokens, device=DEVICE).remainder(num).unsqueeze(1)  # 16 tokens per expert, top-1
        topk_weights = torch.rand(tokens, 1, device=DEVICE)
        us = _graph_us(lambda: moe.routed_experts(x, ids, topk_weights, weights))
        weight_bytes = sum(t.numel() * t.element_size() for t in (w1, w3, w2, s1, s3, s2) if t is not None)
        rows.append({"weights": fmt, "experts": num, "tokens_per_expert": per_expert, "us": round(us, 1),
                     "weight_GB": round(weight_bytes / 1e9, 3), "weight_GBps": round(weight_bytes / us / 1e3),
                     "deepgemm_masked_fp8_GBps_h200": 3590})
    return rows


def prefill_experts() -> list[dict]:
    num, hidden, inter, tokens, top_k = 256, 4096, 2048, 8192, 6
    (w1, _), (w3, _), (w2, _) = (_stack(num, inter, hidden, False), _stack(num, inter, hidden, False),
                                 _stack(num, hidden, inter, False))
    weights = ExpertWeights(w1, w3, w2, 10.0)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.rand(tokens, num, device=DEVICE).argsort(1)[:, :top_k]
    topk_weights = torch.rand(tokens, top_k, device=DEVICE)
    rows, chosen = [], moe_module.block_rows
    for bm in (moe_module.SMALL_BM, moe_module.LARGE_BM):
        moe_module.block_rows = lambda assignments, experts, bm=bm: bm
        us = _graph_us(lambda: TritonMoE(reference=None).routed_experts(x, ids, topk_weights, weights))
        flops = 2 * tokens * top_k * 3 * hidden * inter
        rows.append({"block_rows": bm, "us": round(us), "TFLOPS": round(flops / us / 1e6)})
    moe_module.block_rows = chosen
    return rows


if __name__ == "__main__":
    print(json.dumps({"device": torch.cuda.get_device_name(), "attention": attention(), "experts": experts(),
                      "prefill_experts": prefill_experts()}, indent=1))
