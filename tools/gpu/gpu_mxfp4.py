"""MXFP4 routed experts on the GPU at V4.1-Flash shapes (hidden 5120, intermediate 2304, top-6 of 384 experts,
activations rounded in 1 x 32 blocks): the swap-AB kernel on repacked weights (``moe_mxfp4``) against the byte-layout
kernel it replaces (``moe_fp4_bytes.experts``) and the humming-kernels route (``moe_humming``, where humming is
installed), each checked against the torch reference, printed as JSON lines.

    PYTHONPATH=$PWD:$PWD/backends/nvidia:$PWD/tools/gpu python tools/gpu/gpu_mxfp4.py [--sweep]

Each call (routing table, both projections, the top-k sum) is captured in a CUDA graph and its replays timed
(median of do_bench, L2 flushed). GB/s counts the bytes of the experts the routing touches (packed weights and their
scales), each once. ``--sweep`` also times every ``SWEEP`` tile of the swap-AB kernel per batch, and each
``SPLIT_SWEEP`` value of ``moe_mxfp4.PROGRAMS_PER_SM`` (which decides the K splits) up to 32 tokens. ``--breakdown``
adds, per batch, the device time of each kernel of a replayed call (torch profiler, ``BREAKDOWN_REPLAYS`` replays).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from deepinfer.runtime.quantization import quantize_fp4
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia import moe, moe_humming, moe_mxfp4, moe_mxfp4_layout
from gpu_kernels import _graph_us  # tools/: a call captured in a CUDA graph, its replays timed
import mxfp4_peers  # tools/: humming-kernels and triton_kernels on the same problem (--peers)

DEVICE = torch.device("cuda")
HIDDEN, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6
BATCHES = [int(b) for b in os.environ.get("MXFP4_BATCHES", "1 8 16 32 64 256 2048").split()]
ACTIVATION_BLOCK = 32  # V4.1's weight_block_size (V4's is 128)
# (BN, warps, stages, chunks per loop step): moe_mxfp4.TILES's entries
SWEEP = [(64, 4, 3, 1), (64, 4, 3, 2), (64, 4, 2, 4), (64, 4, 4, 4), (128, 4, 3, 4), (128, 8, 4, 2), (128, 8, 4, 4)]
SPLIT_SWEEP = [1, 2, 8, 16]  # moe_mxfp4.PROGRAMS_PER_SM (its default is timed as "swap-AB")
BREAKDOWN_REPLAYS = 20


def _stack(rows: int, cols: int):
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=DEVICE) * cols**-0.5)
                           for _ in range(EXPERTS)))
    return torch.stack(packed), torch.stack(scales)


class _Deterministic:
    """The humming route with stream-K off in every tile configuration (``moe_humming.STREAM_K``)."""

    def __init__(self, backend):
        self.backend = backend

    def routed_experts(self, *args):
        moe_humming.STREAM_K = False
        try:
            return self.backend.routed_experts(*args)
        finally:
            moe_humming.STREAM_K = True


def _time(backend, x, ids, topk_weights, weights, expected) -> dict:
    got = backend.routed_experts(x, ids, topk_weights, weights).float()
    err = float((got - expected).norm() / expected.norm())
    first = backend.routed_experts(x, ids, topk_weights, weights)
    repeat = bool(torch.equal(first, backend.routed_experts(x, ids, topk_weights, weights)))
    return {"us": round(_graph_us(lambda: backend.routed_experts(x, ids, topk_weights, weights)), 1),
            "err_rel": round(err, 6), "bit_repeatable": repeat}


def _breakdown(fn) -> dict:
    """Device microseconds per replayed call, by kernel name (the first 60 characters)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(BREAKDOWN_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            kernels[name] = kernels.get(name, 0.0) + event.device_time / BREAKDOWN_REPLAYS
    return {name: round(us, 1) for name, us in sorted(kernels.items(), key=lambda item: -item[1])}


def main(sweep: bool, breakdown: bool, peers: bool = False) -> dict:
    torch.manual_seed(0)
    (w1, s1), (w3, s3), (w2, s2) = _stack(INTER, HIDDEN), _stack(INTER, HIDDEN), _stack(HIDDEN, INTER)
    standard = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, ACTIVATION_BLOCK)
    repacked = ExpertWeights(w1.clone(), w3.clone(), w2.clone(), 10.0, s1, s3, s2, ACTIVATION_BLOCK)
    assert moe_mxfp4_layout.prepare(repacked) is None
    per_expert = sum(t[0].numel() * t.element_size() for t in (w1, w3, w2, s1, s3, s2))
    previous = moe.TritonMoE(reference=None, repack_fp4=False)
    ours = moe.TritonMoE(reference=None)
    # the humming-kernels route as the engine wires it (moe_humming), on its own copy (converted in place)
    humming = moe_humming.load()[0] is not None
    converted = ExpertWeights(w1.clone(), w3.clone(), w2.clone(), 10.0, s1.clone(), s3.clone(), s2.clone(),
                              ACTIVATION_BLOCK) if humming else None
    routed = moe.TritonMoE(reference=None, humming=True)
    default_tiles, default_programs = dict(moe_mxfp4.TILES), moe_mxfp4.PROGRAMS_PER_SM
    rows = []
    for tokens in BATCHES:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.rand(tokens, EXPERTS, device=DEVICE).argsort(1)[:, :TOP_K]
        topk_weights = torch.rand(tokens, TOP_K, device=DEVICE)
        expected = TorchMoE().routed_experts(x, ids, topk_weights, standard).float()
        touched = int(ids.unique().numel())
        base = {"tokens": tokens, "experts_touched": touched, "GB": round(touched * per_expert / 1e9, 3)}
        bm = moe.block_rows(ids.numel(), EXPERTS)
        contenders = [("byte layout (previous)", previous, standard, None, None),
                      ("swap-AB", ours, repacked, None, None)]
        if humming:
            contenders.append(("humming route", routed, converted, None, None))
            contenders.append(("humming route, no stream-K", _Deterministic(routed), converted, None, None))
        else:
            rows.append(base | {"kernel": "humming route", "reason": moe_humming.load()[1]})
        if sweep:
            contenders += [(f"swap-AB {tile}", ours, repacked, tile, None) for tile in SWEEP]
            contenders += [(f"swap-AB programs/SM {n}", ours, repacked, None, n) for n in SPLIT_SWEEP if tokens <= 32]
        if peers:  # each peer converted once per batch; a missing or failing one is recorded with its reason
            for peer, run in mxfp4_peers.prepare_all(x, ids, topk_weights, standard).items():
                if isinstance(run, str):
                    rows.append(base | {"kernel": peer, "reason": run})
                    print(json.dumps(rows[-1]), flush=True)
                else:
                    contenders.append((peer, mxfp4_peers.PeerBackend(run), standard, None, None))
        for name, backend, weights, tile, programs_per_sm in contenders:
            moe_mxfp4.TILES = default_tiles | ({bm: tile} if tile else {})
            moe_mxfp4.PROGRAMS_PER_SM = programs_per_sm or default_programs
            try:
                row = base | {"kernel": name} | _time(backend, x, ids, topk_weights, weights, expected)
                row["GBps"] = round(touched * per_expert / row["us"] / 1e3)
            except Exception as exc:  # noqa: BLE001 (a failing tile is recorded, the others still run)
                row = base | {"kernel": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        moe_mxfp4.TILES, moe_mxfp4.PROGRAMS_PER_SM = default_tiles, default_programs
        if breakdown:
            for name, backend, weights in (("byte layout (previous)", previous, standard), ("swap-AB", ours, repacked)):
                row = base | {"kernel": name, "breakdown_us": _breakdown(
                    lambda: backend.routed_experts(x, ids, topk_weights, weights))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"device": torch.cuda.get_device_name(), "rows": rows}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every SWEEP tile of the swap-AB kernel too")
    parser.add_argument("--breakdown", action="store_true", help="each kernel's device time per call, too")
    parser.add_argument("--peers", action="store_true", help="also time humming-kernels and triton_kernels")
    arguments = parser.parse_args()
    main(arguments.sweep, arguments.breakdown, arguments.peers)
