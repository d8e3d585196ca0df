"""FP8 routed experts at decode on the GPU (``deepinfer_nvidia.moe_fp8``, V4-Flash-Base's format): the Triton grouped
kernel and DeepGEMM's masked grouped GEMM, checked against the torch reference and timed, as JSON lines.

    PYTHONPATH=$PWD:$PWD/backends/nvidia:$PWD/tools/gpu python tools/gpu/gpu_fp8_experts.py

One MoE layer of V4-Flash's shape (256 experts top-6, hidden 4096, intermediate 2048, 128 x 128 FP8 tiles) at 1, 16,
64 and 256 tokens, random routing; the same layer with bf16 weights through the Triton kernel the flash4L fixture
uses (twice the bytes) for comparison. Each call is captured in a CUDA graph and its replays timed (median of
do_bench, L2 flushed). GB/s counts the weight bytes of the experts the routing touched; the roofline reads them at
the measured copy rate.
"""

from __future__ import annotations

import json

import torch

from deepinfer.runtime.quantization import quantize_fp8
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia.deepseek_kernels import masked_fp8_gemm
from deepinfer_nvidia.moe import TritonMoE
from gpu_kernels import HBM_COPY_BYTES_PER_S, _graph_us

DEVICE = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 256, 6, 4096, 2048
TOKENS = (1, 16, 64, 256)


def _layer(fp8: bool) -> ExpertWeights:
    def stack(rows, cols):
        w = torch.randn(EXPERTS, rows, cols, device=DEVICE, dtype=torch.bfloat16) * cols**-0.5
        if not fp8:
            return w, None
        pairs = [quantize_fp8(w[e], 128, 128) for e in range(EXPERTS)]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    (w1, s1), (w3, s3), (w2, s2) = stack(INTER, HIDDEN), stack(INTER, HIDDEN), stack(HIDDEN, INTER)
    return ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128 if fp8 else 0)


def main() -> None:
    torch.manual_seed(0)
    gemm, align = masked_fp8_gemm()
    contenders = {"triton fp8": (TritonMoE(TorchMoE()), True), "triton bf16": (TritonMoE(TorchMoE()), False)}
    if gemm is not None:
        contenders["deepgemm masked fp8"] = (TritonMoE(TorchMoE(), masked_gemm=gemm, masked_align=align), True)
    layers = {fp8: _layer(fp8) for fp8 in (True, False)}
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        ids = torch.rand(tokens, EXPERTS, device=DEVICE).argsort(1)[:, :TOP_K]
        topk_weights = torch.rand(tokens, TOP_K, device=DEVICE)
        touched = ids.unique().numel()
        references = {fp8: TorchMoE().routed_experts(x, ids, topk_weights, layers[fp8]).float() for fp8 in layers}
        for name, (moe, fp8) in contenders.items():
            if name.startswith("deepgemm") and tokens > 64:
                continue  # the masked path serves decode steps of up to moe_fp8.MASKED_MAX_TOKENS
            out = moe.routed_experts(x, ids, topk_weights, layers[fp8]).float()
            reference = references[fp8]
            error = float((out - reference).norm() / reference.norm())
            us = _graph_us(lambda moe=moe, fp8=fp8: moe.routed_experts(x, ids, topk_weights, layers[fp8]))
            weight_bytes = touched * 3 * INTER * HIDDEN * (1 if fp8 else 2)
            print(json.dumps({"kernel": name, "tokens": tokens, "experts_touched": touched, "us": round(us, 1),
                              "weight_GBps": round(weight_bytes / us / 1e3),
                              "roofline_us": round(weight_bytes / HBM_COPY_BYTES_PER_S * 1e6, 1),
                              "relative_error_norm": round(error, 5)}), flush=True)


if __name__ == "__main__":
    main()
