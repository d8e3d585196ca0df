"""``deepinfer bench load``: time and peak host memory of loading a checkpoint onto a device.

``--synthesize`` first writes a random checkpoint with DeepSeek-V4-Flash's tensor shapes and formats (hidden 4096,
FP8 128x128 projections, MXFP4 experts), cut to ``--layers`` layers and ``--experts`` experts, in shards of
``--shard-size``, one shard in memory at a time. Peak RSS is the kernel's high-water mark (``VmHWM``, reset just
before loading); the figure that matters is what loading adds above the process before it, less the model itself
when it lives in host memory (device ``cpu``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from deepinfer.loading.convert import ShardWriter, byte_size
from deepinfer.loading.checkpoint import CheckpointIndex
from deepinfer.runtime.linear import quantizable_weights
from deepinfer.loading.weights import dummy_layout, fill_dummy
from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig
from deepinfer.models.contract import Backends
from deepinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

FLASH_SHAPES = dict(
    model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, sliding_window=128,
    moe_intermediate_size=2048, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
    index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rms_norm_eps=1e-6, rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=65536,
    bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16", expert_dtype="fp4",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)


def synthesize(out_dir: Path, layers: int, experts: int, shard_bytes: int, seed: int = 0) -> Path:
    d = dict(FLASH_SHAPES, num_hidden_layers=layers, n_routed_experts=experts,
             compress_ratios=([0, 0] + [4, 128] * layers)[:layers] + [0])
    config = DeepseekV4ModelConfig.from_dict(d)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, Backends(None, None, None, None), config.dtype)
    layout = dummy_layout(model.expected_tensors(), quantizable_weights(model, model.checkpoint_name),
                          config.weight_block_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, shard_bytes)
    for index, name in enumerate(n for n in sorted(layout) if not n.endswith(".scale")):
        scale = f"{name.removesuffix('weight')}scale"
        group = {n: torch.empty(layout[n][0], dtype=layout[n][1]) for n in (name, scale) if n in layout}
        fill_dummy(group, seed + index, experts)
        for expert in _per_expert(group):
            writer.add(expert)
    writer.finish()
    (out_dir / "config.json").write_text(json.dumps(d, indent=2))
    return out_dir


def _per_expert(group: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Stacked expert tensors as the release stores them: one weight (and its scale) per expert."""
    if not any(".ffn.experts." in name for name in group):
        return [group]
    experts = next(iter(group.values())).shape[0]
    split = [name.rsplit(".experts.", 1) for name in group]
    return [{f"{prefix}.experts.{e}.{leaf}": group[f"{prefix}.experts.{leaf}"][e].clone() for prefix, leaf in split}
            for e in range(experts)]


def _status_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    # Linux resets VmHWM to the current RSS on "5" (ru_maxrss cannot be reset, and survives even exec)
    Path("/proc/self/clear_refs").write_text("5")


def _measured(load, device: torch.device, host_resident: bool) -> dict:
    """Seconds and peak host memory ``load()`` adds; the bytes it returns (left on ``device``) are not counted
    when they live in host memory."""
    _reset_peak_rss()
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    tensors = load()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    kept = sum(t.numel() * t.element_size() for t in tensors)
    return {"seconds": seconds, "bytes_on_device": kept, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak,
            "added_rss_bytes": peak - baseline - (kept if host_resident else 0)}


def measure(model_dir: Path, device: torch.device, quantization: str) -> dict:
    """DeepInfer's loader, then (on an accelerator) the plain way as the peer: safetensors ``load_file`` of each
    shard straight onto the device, which keeps every tensor in the model's checkpoint format too."""
    from safetensors.torch import load_file

    from deepinfer.engine.config import EngineConfig
    from deepinfer.loading.tokenizer import load_tokenizer
    from deepinfer.loading.model_loader import load_model
    from deepinfer.loading.model_registry import model_config
    from deepinfer.plugins.builtin.torch_attention import TorchAttention
    from deepinfer.plugins.builtin.torch_linear import TorchLinear
    from deepinfer.plugins.builtin.torch_mhc import TorchMHC
    from deepinfer.plugins.builtin.torch_moe import TorchMoE

    config = model_config(model_dir)
    tokenizer = load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    if device.type == "cuda":
        torch.empty(1, device=device)  # the CUDA context's host memory belongs to the baseline
    index = CheckpointIndex.from_dir(model_dir)
    shard_sizes = [(model_dir / f).stat().st_size for f in index.files]
    host = device.type == "cpu"

    def deepinfer_load():
        model = load_model(config, model_dir, attention=TorchAttention(), moe=TorchMoE(), linear=TorchLinear(),
                           mhc=TorchMHC(), dtype=config.dtype, device=device, tokenizer=tokenizer,
                           quantization=quantization, engram_tables=EngineConfig().engram_tables)
        return [*model.parameters(), *model.buffers()]

    def safetensors_load():
        return [t for f in index.files for t in load_file(model_dir / f, device=str(device)).values()]

    largest = max(shard_sizes)
    ours = _measured(deepinfer_load, device, host)
    results = {
        "checkpoint_bytes": sum(shard_sizes), "shards": len(shard_sizes), "largest_shard_bytes": largest,
        "device": str(device), "quantization": quantization,
        "deepinfer": {**ours, "added_rss_over_largest_shard": ours["added_rss_bytes"] / largest},
    }
    if device.type != "cpu":  # on the CPU load_file only maps the files, so there is nothing to compare
        torch.cuda.empty_cache()
        peer = _measured(safetensors_load, device, host)
        results["safetensors_load_file"] = {**peer, "added_rss_over_largest_shard": peer["added_rss_bytes"] / largest}
        results["ratio_seconds"] = ours["seconds"] / peer["seconds"]
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (written first with --synthesize)")
    parser.add_argument("--synthesize", action="store_true", help="write a V4-Flash-shaped random checkpoint first")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--shard-size", type=byte_size, default="1GiB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"])
    parser.add_argument("--output-json", help="write the results here")


def main(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model)
    if args.synthesize:
        start = time.perf_counter()
        synthesize(model_dir, args.layers, args.experts, args.shard_size)
        print(f"wrote {model_dir} in {time.perf_counter() - start:.0f} s")
    results = {"machine": f"{platform.machine()}, torch {torch.__version__}",
               **measure(model_dir, torch.device(args.device), args.quantization)}
    text = json.dumps(results, indent=2)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return results
