"""V4.1-Flash's FP8 projections at decode sizes on the GPU: ``deepinfer_nvidia.fp8_linear`` checked against the torch
reference and timed, printed as JSON lines.

    PYTHONPATH=$PWD:$PWD/backends/nvidia:$PWD/tools/gpu python tools/gpu/gpu_fp8_linear.py [--peer MODULE]

Shapes: every FP8 projection of a V4.1-Flash layer (32 x 32 weight tiles, activations rounded in 1 x 32 blocks) at
1, 16 and 64 rows (``--rows``: others, e.g. 6 and 192 for speculative verification, 2048 for a prefill). Each
strategy (``STRATEGIES``) sets some of ``fp8_linear``'s switches; V4.1's grouped ``wo_a`` is timed last
(``grouped_fp8_linear`` against cuBLAS's einsum on its bf16 copy); ``--peer`` also times another module's
``fp8_linear`` (say, the previous commit's file saved as ``deepinfer_nvidia/fp8_linear_previous.py`` for the run);
cuBLAS's bf16 GEMM on the dequantized weight is timed as a reference for speed only. A CUDA graph of
calls on distinct copies of the weight (over 256 MB in all: none is still in L2) is replayed and timed (median of
do_bench), per call: no graph launch in the figure, as inside the engine's decode graph. The roofline reads the
weight and its scales once at the H200's measured copy rate, or an H100's HBM3 peak.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch

from deepinfer.runtime.quantization import blockwise_linear, dequantize, quantize_fp8
from deepinfer_nvidia import fp8_gemv, fp8_linear as module
import triton.testing
from gpu_kernels import HBM_COPY_BYTES_PER_S

DEVICE = torch.device("cuda")
BLOCK = 32
# (name, out, in) of a V4.1-Flash layer's FP8 projections as the engine calls them (hidden 5120, q rank 1280, 64 x 512
# heads in 8 groups of output rank 1024, shared expert 2304 wide; wq_a with wkv and w1 with w3 are one GEMM each
# once loaded, `SharedInput`), and an index layer's query projection (32 heads of 128)
PROJECTIONS = [("wq_a + wkv", 1792, 5120), ("wq_b", 32768, 1280), ("wo_b", 5120, 8192),
               ("shared w1 + w3", 4608, 5120), ("shared w2", 5120, 2304), ("indexer wq_b", 4096, 1280)]
ROWS = (1, 16, 64)
STRATEGIES = {
    "this kernel": {},
    "tensor cores (no one-row GEMV)": {"GEMV": False},
    "tensor cores, 6 stages": {"GEMV": False, "FEW_ROWS_TILES": {"BN": 64, "num_warps": 4, "num_stages": 6}},
    "tensor cores, 8 programs an SM": {"GEMV": False, "FEW_ROWS_PROGRAMS_PER_SM": 8},
    "gemv, 10 programs an SM": {"GEMV_PROGRAMS_PER_SM": 10},
    "gemv, 3 programs an SM": {"GEMV_PROGRAMS_PER_SM": 3},
    "gemv, 4 warps, 12 an SM": {"GEMV_TILES": {"BN": 32, "KB": 256, "num_warps": 4}, "GEMV_PROGRAMS_PER_SM": 12},
    "gemv, 128-byte steps, 1 warp": {"GEMV_TILES": {"BN": 32, "KB": 128, "num_warps": 1}, "GEMV_PROGRAMS_PER_SM": 16},
    # more weight bytes in flight a program: a second chunk read ahead, or wider chunks over more warps
    "gemv, two chunks ahead": {"GEMV_AHEAD": 2},
    "gemv, two chunks ahead, 5 an SM": {"GEMV_AHEAD": 2, "GEMV_PROGRAMS_PER_SM": 5},
    "gemv, two chunks ahead, 4 an SM": {"GEMV_AHEAD": 2, "GEMV_PROGRAMS_PER_SM": 4},
    "gemv, two chunks ahead, 2 an SM": {"GEMV_AHEAD": 2, "GEMV_PROGRAMS_PER_SM": 2},
    "gemv, 512-byte steps, 4 warps": {"GEMV_TILES": {"BN": 32, "KB": 512, "num_warps": 4, "num_stages": 1}},
    "gemv, 512-byte steps, 4 warps, two ahead": {"GEMV_TILES": {"BN": 32, "KB": 512, "num_warps": 4, "num_stages": 1},
                                                 "GEMV_AHEAD": 2},
    "gemv, 512-byte steps, 8 warps, two ahead": {"GEMV_TILES": {"BN": 32, "KB": 512, "num_warps": 8, "num_stages": 1},
                                                 "GEMV_AHEAD": 2},
    # speculative verification steps: 6 rows a request, 192 at batch 32 (the autotuned GEMM's range by default)
    "few-rows kernel to 256 rows": {"FEW_ROWS": 256},
    "few-rows kernel to 256 rows, 8 warps": {"FEW_ROWS": 256, "FEW_ROWS_TILES": {"BN": 64, "num_warps": 8,
                                                                                 "num_stages": 3}},
    "cuBLAS on the expanded weight": {"BF16_GEMM_MIN_ROWS": 17, "FEW_ROWS": 16},
}
# the fewest rows each many-row strategy is timed at (below, another kernel would serve the call)
MANY_ROWS_ONLY = {"few-rows kernel to 256 rows": 65, "few-rows kernel to 256 rows, 8 warps": 65,
                  "cuBLAS on the expanded weight": 17}
ONE_ROW_ONLY = {name for name, switches in STRATEGIES.items() if any(k.startswith("GEMV") for k in switches)}
STREAMED_BYTES = 256 << 20


def _holder(switch: str):
    """The module a strategy's switch lives in: the one-row GEMV's own, or fp8_linear's."""
    return fp8_gemv if switch.startswith("GEMV") else module


def _per_call_us(call, x, copies) -> float:
    """One call per weight copy in a CUDA graph, its replays timed; per call."""
    for weight, scale in copies:  # compile and tune outside the capture
        call(x, weight, scale, BLOCK)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weight, scale in copies:
            call(x, weight, scale, BLOCK)
    return triton.testing.do_bench(graph.replay, warmup=5, rep=40) * 1e3 / len(copies)


def _copy_rate() -> float:
    """Bytes a second the roofline reads at: the H200's measured copy rate, or an H100's HBM3 peak (its copy rate
    was not measured)."""
    return 3.35e12 if "H100" in torch.cuda.get_device_name() else HBM_COPY_BYTES_PER_S


def grouped_wo_a(row_counts: tuple[int, ...]) -> None:
    """V4.1-Flash's ``wo_a`` (8 head groups of 4096 columns onto 1024 rows each, FP8 in 32 x 32 tiles) through
    ``grouped_fp8_linear`` against cuBLAS's bf16 einsum on the dequantized copy (what the engine ran before)."""
    groups, rows_a_group, cols = 8, 1024, 4096
    weight, scale = quantize_fp8(torch.randn(groups * rows_a_group, cols, device=DEVICE) * cols**-0.5, BLOCK, BLOCK)
    dense = dequantize(weight, scale, torch.bfloat16).view(groups, rows_a_group, cols)
    copies = [(weight.clone(), scale.clone()) for _ in range(max(4, STREAMED_BYTES // weight.numel()))]
    dense_copies = [(dense.clone(), None) for _ in range(max(4, STREAMED_BYTES // (2 * dense.numel())))]
    for rows in row_counts:
        x = torch.randn(rows, groups, cols, dtype=torch.bfloat16, device=DEVICE)
        expected = torch.einsum("tgc,grc->tgr", x.float(), dense.float())
        got = module.grouped_fp8_linear(x, weight, scale).float()
        print(json.dumps({"projection": "wo_a (grouped)", "rows": rows,
                          "roofline_us": round((weight.numel() + scale.numel()) / _copy_rate() * 1e6, 1),
                          "err_rel": float((got - expected).abs().max() / expected.abs().max()),
                          "grouped_fp8_linear_us": round(_per_call_us(
                              lambda x, w, s, b: module.grouped_fp8_linear(x, w, s), x, copies), 1),
                          "cublas_bf16_einsum_us": round(_per_call_us(
                              lambda x, w, s, b: torch.einsum("tgc,grc->tgr", x, w), x, dense_copies), 1)}),
              flush=True)


def main(peer: str | None, row_counts: tuple[int, ...], strategies: list[str]) -> None:
    torch.manual_seed(0)
    contenders = {name: (module.fp8_linear, STRATEGIES[name]) for name in strategies}
    if peer:
        contenders[f"peer: {peer}"] = (importlib.import_module(peer).fp8_linear, {})
    defaults = {name: getattr(_holder(name), name) for switches in STRATEGIES.values() for name in switches}
    totals: dict[tuple[int, str], float] = {}
    for name, out, cols in PROJECTIONS:
        weight, scale = quantize_fp8(torch.randn(out, cols, device=DEVICE) * cols**-0.5, BLOCK, BLOCK)
        dense = dequantize(weight, scale, torch.bfloat16)
        nbytes = weight.numel() + scale.numel()
        copies = [(weight.clone(), scale.clone()) for _ in range(max(4, STREAMED_BYTES // nbytes))]
        dense_copies = [(dense.clone(), None) for _ in range(max(4, STREAMED_BYTES // (2 * dense.numel())))]
        for rows in row_counts:
            x = torch.randn(rows, cols, dtype=torch.bfloat16, device=DEVICE)
            expected = blockwise_linear(x.float(), weight, scale, BLOCK)
            row = {"projection": name, "shape": [out, cols], "rows": rows,
                   "roofline_us": round(nbytes / _copy_rate() * 1e6, 1),
                   "cublas_bf16_us": round(_per_call_us(lambda x, w, s, b: x @ w.T, x, dense_copies), 1)}
            for contender, (call, switches) in contenders.items():
                if (rows > 1 and contender in ONE_ROW_ONLY) or rows < MANY_ROWS_ONLY.get(contender, 0):
                    continue
                for attribute, value in defaults.items():
                    setattr(_holder(attribute), attribute, switches.get(attribute, value))
                try:
                    got = call(x, weight, scale, BLOCK).float()
                    us = _per_call_us(call, x, copies)
                    row[contender] = {"us": round(us, 1), "err_rel": float((got - expected).abs().max()
                                                                            / expected.abs().max())}
                    totals[rows, contender] = totals.get((rows, contender), 0.0) + us
                except Exception as exc:  # noqa: BLE001 (a failing strategy is recorded, the others still run)
                    row[contender] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps(row), flush=True)
    for attribute, value in defaults.items():
        setattr(_holder(attribute), attribute, value)
    print(json.dumps({"layer_totals_us": {f"{rows} rows, {c}": round(us, 1) for (rows, c), us in totals.items()}}))
    grouped_wo_a(row_counts)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", help="a module whose fp8_linear is timed alongside (the previous kernel)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (default {ROWS})")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES),
                        help="the strategies timed (default: all)")
    args = parser.parse_args()
    main(args.peer, tuple(args.rows), args.strategies)
