"""MXFP4 routed experts on the GPU: ``deepinfer_nvidia.moe`` checked against the torch reference and timed at
V4.1-Flash shapes (hidden 5120, intermediate 2304, top-6 of 384 experts, activations rounded in 1 x 32 blocks),
printed as JSON lines.

    PYTHONPATH=$PWD:$PWD/backends/nvidia:$PWD/tools python tools/gpu_mxfp4.py [--peer MODULE]

Each strategy (``STRATEGIES``) sets some of ``moe``'s switches (scales read four to a word or a byte at a time).
``--peer`` also times another module's
``TritonMoE`` in the same run (say, a copy of the previous commit's ``moe.py`` saved as
``deepinfer_nvidia/moe_previous.py`` for the run). Each call is captured in a CUDA graph and its replays timed
(median of do_bench, L2 flushed); GB/s counts the bytes of the experts the routing touches (packed weights and their
scales), each once.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from deepinfer.core.quantization import quantize_fp4
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia import moe as moe_module
from gpu_kernels import _graph_us  # tools/: a call captured in a CUDA graph, its replays timed

DEVICE = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6
CASES = {"batch 1": (1, TOP_K), "batch 64": (64, TOP_K), "batch 16": (16, TOP_K), "prefill 2048": (2048, TOP_K)}
ACTIVATION_BLOCK = 32  # V4.1's weight_block_size (V4's is 128)
STRATEGIES = {"this kernel": {}, "scales a byte at a time": {"WORD_SCALES": False}}


def _stack(rows: int, cols: int):
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=DEVICE) * cols**-0.5)
                           for _ in range(EXPERTS)))
    return torch.stack(packed), torch.stack(scales)


# a subset of moe.FP4_TILE_SHAPES: every strategy is tuned afresh, and a device call has minutes
TILE_SHAPES = [(32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (16, 128, 4, 4)]


def _time(moe, x, ids, topk_weights, weights, expected) -> dict:
    try:
        got = moe.routed_experts(x, ids, topk_weights, weights).float()
        err = float((got - expected).abs().max() / expected.abs().max())
        return {"us": round(_graph_us(lambda: moe.routed_experts(x, ids, topk_weights, weights)), 1),
                "max_err_rel": round(err, 5)}
    except Exception as exc:  # noqa: BLE001 (a failing strategy is recorded, the others still run)
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main(peer: str | None) -> dict:
    torch.manual_seed(0)
    moe_module.FP4_TILE_SHAPES = TILE_SHAPES
    (w1, s1), (w3, s3), (w2, s2) = _stack(INTER, HIDDEN), _stack(INTER, HIDDEN), _stack(HIDDEN, INTER)
    weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, ACTIVATION_BLOCK)
    per_expert = sum(t[0].numel() * t.element_size() for t in (w1, w3, w2, s1, s3, s2))
    reference = TorchMoE()
    contenders = {name: (moe_module, switches) for name, switches in STRATEGIES.items()}
    if peer:
        peer_module = importlib.import_module(peer)
        peer_module.FP4_TILE_SHAPES = TILE_SHAPES
        contenders[f"peer: {peer}"] = (peer_module, {})
    defaults = {name: getattr(moe_module, name) for switches in STRATEGIES.values() for name in switches}
    rows = []
    for case, (tokens, top_k) in CASES.items():
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.rand(tokens, EXPERTS, device=DEVICE).argsort(1)[:, :top_k]
        topk_weights = torch.rand(tokens, top_k, device=DEVICE)
        expected = reference.routed_experts(x, ids, topk_weights, weights).float()
        touched = int(ids.unique().numel()) * per_expert
        for name, (module, switches) in contenders.items():
            for attribute, value in defaults.items():
                setattr(moe_module, attribute, switches.get(attribute, value))
            row = {"case": case, "strategy": name, "tokens": tokens, "experts_touched": touched // per_expert,
                   "GB": round(touched / 1e9, 3)}
            row |= _time(module.TritonMoE(reference=None), x, ids, topk_weights, weights, expected)
            if "us" in row:
                row["GBps"] = round(touched / row["us"] / 1e3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for attribute, value in defaults.items():
        setattr(moe_module, attribute, value)
    return {"device": torch.cuda.get_device_name(), "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", help="a module whose TritonMoE is timed alongside (the previous kernel)")
    main(parser.parse_args().peer)
