"""The NVIDIA backend's Triton kernels on a GPU, in one run: correctness, kernel times, engine check.

    export PYTHONPATH=$PWD:$PWD/backends/nvidia && python tools/gpu/gpu_nvidia_linear.py $OUT

1. ``tests/test_nvidia_fp8_linear.py`` natively (bit-exact activation rounding, GEMM within fp32 reordering).
2. Kernel times at DeepSeek-V4-Flash projection shapes (128x128 tiles) and V4.1-Flash ones (32x32), decode and
   prefill token counts: Triton FP8 vs the torch reference (dequantize + fp32 matmul) vs a bf16 cuBLAS matmul of the
   same shape on dequantized weights (what a plain engine runs), with the HBM roofline of the FP8 weights.
3. MXFP4 routed experts at V4-Flash shapes (256 experts, top-6): Triton vs the torch reference, weight GB/s.
4. The embedded model with the plugin (linear and MoE) vs the torch reference: greedy tokens and decode tok/s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton.testing

torch.set_flush_denormal(True)

from deepinfer.runtime.quantization import blockwise_linear, dequantize, quantize_fp8  # noqa: E402
from deepinfer_nvidia.fp8_linear import TritonLinear  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
SHAPES = {  # name: (out, in, tile)
    "v4 wq_b 32768x1024": (32768, 1024, 128),
    "v4 wo_b 4096x8192": (4096, 8192, 128),
    "v4 shared w1 2048x4096": (2048, 4096, 128),
    "v4.1 wq_a 1536x5120": (1536, 5120, 32),
    "v4.1 wo_b 5120x8192": (5120, 8192, 32),
}
TOKENS = (1, 64, 4096)


def kernels() -> list[dict]:
    rows, triton_linear = [], TritonLinear()
    for name, (out, cols, tile) in SHAPES.items():
        weight, scale = quantize_fp8(torch.randn(out, cols, device="cuda") * cols**-0.5, tile, tile)
        dense = dequantize(weight, scale, torch.bfloat16)
        for tokens in TOKENS:
            x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
            ours = triton.testing.do_bench(lambda: triton_linear.linear(x, weight, scale, tile))
            reference = triton.testing.do_bench(lambda: blockwise_linear(x, weight, scale, tile))
            cublas = triton.testing.do_bench(lambda: x @ dense.T)
            roofline_ms = (weight.numel() + 2 * tokens * (cols + out)) / HBM_BYTES_PER_S * 1e3
            rows.append({"shape": name, "tokens": tokens, "triton_fp8_ms": ours, "torch_reference_ms": reference,
                         "cublas_bf16_ms": cublas, "fp8_weight_roofline_ms": roofline_ms,
                         "tflops_triton": 2 * tokens * out * cols / ours / 1e9})
            print(rows[-1], flush=True)
    return rows


def moe() -> list[dict]:
    """V4-Flash experts (hidden 4096, intermediate 2048, MXFP4, top-6) for a few token counts."""
    from deepinfer.runtime.quantization import quantize_fp4
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer.plugins.interfaces import ExpertWeights
    from deepinfer_nvidia.moe import TritonMoE

    experts, hidden, inter, top_k = 256, 4096, 2048, 6

    def stack(rows, cols):
        one = [quantize_fp4(torch.randn(rows, cols, device="cuda") * cols**-0.5) for _ in range(8)]
        return (torch.stack([one[e % 8][0] for e in range(experts)]), torch.stack([one[e % 8][1] for e in range(experts)]))

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)
    weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128)
    per_expert_bytes = 3 * (inter * hidden // 2 + inter * hidden // 32)
    rows, triton_moe, reference = [], TritonMoE(TorchMoE()), TorchMoE()
    for tokens in (1, 16, 64, 256):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)])
        topk_weights = torch.rand(tokens, top_k, device="cuda")
        ours = triton.testing.do_bench(lambda: triton_moe.routed_experts(x, ids, topk_weights, weights))
        ref = triton.testing.do_bench(lambda: reference.routed_experts(x, ids, topk_weights, weights))
        touched = int(ids.unique().numel())
        rows.append({"tokens": tokens, "experts_touched": touched, "triton_ms": ours, "torch_reference_ms": ref,
                     "weight_gb_per_s": touched * per_expert_bytes / ours / 1e6,
                     "roofline_ms": touched * per_expert_bytes / HBM_BYTES_PER_S * 1e3})
        print(rows[-1], flush=True)
    return rows


def engine() -> dict:
    from deepinfer import LLM, SamplingParams
    from deepinfer.plugins.manager import registered
    from deepinfer_nvidia import plugin

    from deepinfer.testing.probes import prefill_logits

    prompts = ["def fibonacci(n):", '"""Return the', "import os\n", "class Stack:"] * 4
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    code = Path("deepinfer/engine/scheduler.py").read_text()
    results, logits = {}, {}
    for label in ("torch-reference", "triton"):
        if label == "triton":
            with registered(plugin, "nvidia"):
                llm = LLM("deepinfer-tiny-v4.1", dtype="bfloat16", device="cuda")
        else:
            llm = LLM("deepinfer-tiny-v4.1", dtype="bfloat16", device="cuda")
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        results[label] = {"output_tokens_per_s": 64 * len(prompts) / elapsed,
                          "tokens": [o.outputs[0].token_ids for o in outputs]}
        logits[label] = prefill_logits(llm, llm.engine.tokenizer.encode(code)[:512]).float()
    same = sum(a == b for a, b in zip(results["torch-reference"]["tokens"], results["triton"]["tokens"]))
    a, b = logits["triton"], logits["torch-reference"]
    return {label: r["output_tokens_per_s"] for label, r in results.items()} | {
        "identical_greedy_outputs": same, "outputs": len(prompts),
        "prefill_logits_relative_difference": float((a - b).norm() / b.norm()),
        "prefill_top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_nvidia_fp8_linear.py",
                            "tests/test_nvidia_moe.py"],
                           capture_output=True, text=True)
    print(tests.stdout[-2000:], tests.stderr[-2000:])
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "tests": tests.stdout.strip().splitlines()[-1], "kernels": kernels(), "moe": moe(), "engine": engine()}
    (out / "gpu_nvidia_linear.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["engine"], indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
