"""Quantized loading on a GPU, in one run: results go to $OUT as JSON.

    export PYTHONPATH=$PWD && python tools/gpu/gpu_quantized_check.py $OUT

1. ``deepinfer bench load`` on a V4-Flash-shaped synthetic checkpoint (6 layers, 32 experts, 1 GiB shards): time
   and peak host RSS of DeepInfer's loader against safetensors ``load_file`` onto the GPU.
2. ``load_format="dummy"`` of the same shapes: time and device memory, no files read.
3. The tiny V4.1 fixture on the GPU: weights kept FP8/MXFP4 vs dequantized (``quantization="none"``): logits and
   greedy tokens, fp32 and bf16.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

torch.set_flush_denormal(True)

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.testing.probes import prefill_logits  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "v41_tiny"


def bench_load(out: Path, synth: Path) -> dict:
    cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "load", "--model", str(synth), "--synthesize",
           "--layers", "6", "--experts", "32", "--shard-size", "1GiB", "--device", "cuda",
           "--output-json", str(out / "bench_load.json")]
    subprocess.run(cmd, check=True)
    return json.loads((out / "bench_load.json").read_text())


def dummy(synth: Path) -> dict:
    from deepinfer.engine.config import EngineConfig
    from deepinfer.loading.model_loader import load_model
    from deepinfer.loading.model_registry import model_config
    from deepinfer.plugins.builtin.torch_attention import TorchAttention
    from deepinfer.plugins.builtin.torch_linear import TorchLinear
    from deepinfer.plugins.builtin.torch_mhc import TorchMHC
    from deepinfer.plugins.builtin.torch_moe import TorchMoE

    config = model_config(synth)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = load_model(config, synth, attention=TorchAttention(), moe=TorchMoE(), linear=TorchLinear(),
                       mhc=TorchMHC(), dtype=config.dtype, device=torch.device("cuda"), load_format="dummy",
                       engram_tables=EngineConfig().engram_tables)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    checkpoint = sum(f.stat().st_size for f in synth.glob("*.safetensors"))
    return {"seconds": seconds, "weight_bytes": weights, "checkpoint_bytes": checkpoint,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated()}


def fixture_on_gpu() -> dict:
    prompt = torch.randint(3, 512, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    results = {}
    for dtype in ("float32", "bfloat16"):
        kept = LLM(str(FIXTURE), dtype=dtype, device="cuda")
        plain = LLM(str(FIXTURE), dtype=dtype, device="cuda", quantization="none")
        a, b = prefill_logits(kept, prompt), prefill_logits(plain, prompt)
        greedy = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for llm in (kept, plain)]
        results[dtype] = {"relative_logit_difference": float((a - b).norm() / b.norm()),
                          "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                          "greedy_kept": greedy[0], "greedy_dequantized": greedy[1]}
    return results


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    synth = Path("/tmp/deepinfer-synth-v4")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "bench_load": bench_load(out, synth), "dummy": dummy(synth), "fixture": fixture_on_gpu()}
    (out / "gpu_quantized_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
