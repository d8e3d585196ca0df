"""A model's decode roofline: the bytes one decode step reads at each batch size, and the tokens/s that reading them
at a measured copy rate allows (no GPU needed: the model is built on the meta device).

    python -m deepinfer.testing.flash_fixtures v41flash8L /tmp/v41flash8L
    python tools/profiling/decode_roofline.py /tmp/v41flash8L --batch-sizes 1 64 --copy-gbps 4223
    python tools/profiling/decode_roofline.py /tmp/v41flash --expert-parallel 8   # per GPU, 8 ranks

With ``--expert-parallel N`` the figures are per GPU of N running attention data-parallel and experts
expert-parallel (the full-scale layout): each rank decodes its own batch B and holds every weight outside the routed
experts, and E/N experts, which the N ranks' B x N tokens route to; the weights each GPU holds are printed too.

Weights only, in the formats ``load_format="dummy"`` gives them (the checkpoint's: FP8 projections and MXFP4
experts where its config says so). Per step:
- every weight outside the routed experts, once; the token embedding and Engram's tables only in the rows the step
  gathers;
- each routed expert the step's routing touches, once: with uniform routing a layer of E experts, top-k, touches
  E (1 - (1 - k/E)^B) of them on average at batch B (hash-routed layers spread tokens the same way).
The KV cache a step reads is left out; at the 512-token contexts of BENCHMARKS.md it is a few MB per sequence.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.runtime.linear import quantizable_weights
from deepinfer.loading.tokenizer import load_tokenizer
from deepinfer.loading.weights import dummy_layout
from deepinfer.models.contract import Backends
from deepinfer.loading.model_registry import model_class, model_config
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.builtin.torch_linear import TorchLinear
from deepinfer.plugins.builtin.torch_mhc import TorchMHC
from deepinfer.plugins.builtin.torch_moe import TorchMoE


def tensor_sizes(model_dir: Path) -> tuple[dict[str, tuple[int, int]], object]:
    """(bytes, rows) of every tensor as ``load_format="dummy"`` stores it, by checkpoint name; and the config."""
    config = model_config(model_dir)
    dtype = getattr(torch, str(config.dtype).removeprefix("torch.")) if config.dtype else torch.bfloat16
    with torch.device("meta"):
        model = model_class(config)(config, Backends(TorchAttention(), TorchMoE(), TorchLinear(), TorchMHC()), dtype,
                                    tokenizer=load_tokenizer(model_dir))
    expected = model.expected_tensors()
    quantizable = quantizable_weights(model, model.checkpoint_name) if config.quantization_config else set()
    layout = dummy_layout(expected, quantizable, config.weight_block_size)
    return {name: (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(), shape[0])
            for name, (shape, dtype) in layout.items()}, config


def step_bytes(sizes: dict[str, tuple[int, int]], config, batch: int, ranks: int = 1) -> dict[str, float]:
    """Bytes one GPU reads in a decode step of ``batch`` sequences, by part; with ``ranks`` > 1, one of that many
    expert-parallel ranks, each decoding its own ``batch``."""
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    # the chance that a given expert serves any of the step's tokens, all ranks' tokens routed together
    touched = 1 - (1 - top_k / experts) ** (batch * ranks)
    # Engram gathers one row per head and n-gram order (2..max) for each token
    engram_rows = getattr(config, "engram_n_heads", 0) * (getattr(config, "engram_max_ngram_size", 1) - 1)
    parts = {"routed experts": 0.0, "gathered rows": 0.0, "other weights": 0.0}
    for name, (size, rows) in sizes.items():
        if ".experts." in name:
            parts["routed experts"] += size * touched / ranks  # this rank's E/N experts
        elif name.startswith("embed."):
            parts["gathered rows"] += size / rows * batch
        elif ".engram.embed." in name:
            parts["gathered rows"] += size / rows * batch * engram_rows
        else:
            parts["other weights"] += size
    return parts


def held_bytes(sizes: dict[str, tuple[int, int]], ranks: int = 1) -> dict[str, float]:
    """The weights one of ``ranks`` expert-parallel GPUs holds, by part (Engram's tables apart: where they live is
    ``DEEPINFER_ENGRAM_TABLES``'s choice, the host for the released V4.1-Flash's)."""
    parts = {"routed experts": 0.0, "engram tables": 0.0, "other weights": 0.0}
    for name, (size, _) in sizes.items():
        if ".experts." in name:
            parts["routed experts"] += size / ranks
        elif ".engram.embed." in name:
            parts["engram tables"] += size
        else:
            parts["other weights"] += size
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--copy-gbps", type=float, default=4223.0,
                        help="measured copy rate, read + write (an H200 of the GPU box: 4223)")
    parser.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                        help="figures per GPU of N data-parallel attention, expert-parallel ranks")
    args = parser.parse_args()
    if args.expert_parallel < 1:
        parser.error(f"--expert-parallel must be at least 1, got {args.expert_parallel}")
    sizes, config = tensor_sizes(args.model_dir)
    held = held_bytes(sizes, args.expert_parallel)
    print(json.dumps({"ranks": args.expert_parallel, "weights_held_per_gpu_GB": {
        part: round(value / 1e9, 2) for part, value in held.items()}}))
    for batch in args.batch_sizes:
        parts = step_bytes(sizes, config, batch, args.expert_parallel)
        total = sum(parts.values())
        print(json.dumps({"ranks": args.expert_parallel, "batch_per_gpu": batch, "GB_per_step": round(total / 1e9, 3),
                          **{f"{part} GB": round(value / 1e9, 3) for part, value in parts.items()},
                          "roofline_ms": round(total / (args.copy_gbps * 1e6), 3),
                          "roofline_tok_s_per_gpu": round(batch * args.copy_gbps * 1e9 / total, 1)}))


if __name__ == "__main__":
    main()
