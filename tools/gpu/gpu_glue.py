"""A decode step's glue on the H200 at DeepSeek-V4-Flash shapes: each fused NVIDIA kernel against the torch
reference it replaces, in µs per call with the launches each makes, printed as JSON (issues 6 and 7).

    PYTHONPATH=$PWD:$PWD/backends/nvidia python tools/gpu/gpu_glue.py

Each call is captured in a CUDA graph and its replays timed (``tools/gpu/gpu_kernels._graph_us``), so the figures are
device time inside a replayed step, where these ops run: routing (E=256, H=4096, top-6, sqrt-softplus), one mHC
sublayer's weights (n=4, D=4096), the attention norms (q_lora 1024; 64 heads x 512 without weight), the shared
expert's SwiGLU (2048), the CSA compressor's state rows (2 x 512 wide) and a padded step's cache slots (flash4L's
layout: window 128, ratios 4 and 128, 1024-token context). Inputs are fresh random values; batch 1 and 64.
"""

from __future__ import annotations

import json

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer.runner.forward_batch import StepInputs
from deepinfer.runtime.slots import SlotLayout
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.builtin.torch_mhc import TorchMHC
from deepinfer.plugins.builtin.torch_moe import TorchMoE
from deepinfer.plugins.interfaces import RouterWeights
from deepinfer_nvidia.mhc import TritonMHC
from deepinfer_nvidia.moe import TritonMoE
from deepinfer_nvidia.attention import TritonAttention
from gpu_kernels import DEVICE, _graph_us

HIDDEN, EXPERTS, BLOCK, WINDOW, CONTEXT = 4096, 256, 128, 128, 1024


def _launches(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _slots_problem(batch: int):
    overlaps = {4: 2, 128: 1}
    rows = {"swa": BLOCK, "comp4": BLOCK // 4, "state4": BLOCK // 2, "comp128": 1, "state128": 1}
    layout = SlotLayout(WINDOW, BLOCK, rows, overlaps)
    blocks = CONTEXT // BLOCK
    tables = {k: torch.randperm(batch * blocks * 2, device=DEVICE)[: batch * blocks].view(batch, blocks) for k in rows}
    positions = torch.randint(CONTEXT // 2, CONTEXT, (batch,), device=DEVICE)
    inputs = StepInputs(positions.clone(), positions, torch.arange(batch, device=DEVICE),
                        torch.arange(batch, device=DEVICE), tables, {}, {}, {r: CONTEXT // r for r in overlaps},
                        {k: 10**6 for k in rows})
    return layout, inputs


def cases(batch: int) -> dict:
    x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    router = RouterWeights(torch.randn(EXPERTS, HIDDEN, device=DEVICE) * 0.02, torch.randn(EXPERTS, device=DEVICE),
                           None, 6, "sqrtsoftplus", True, 1.5)
    token_ids = torch.randint(0, 1000, (batch,), device=DEVICE)
    streams = torch.randn(batch, 4, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    fn = torch.randn(24, 4 * HIDDEN, device=DEVICE) * 0.01
    base, scale = torch.randn(24, device=DEVICE), torch.rand(3, device=DEVICE)
    qr = torch.randn(batch, 1024, dtype=torch.bfloat16, device=DEVICE)
    q = torch.randn(batch, 64, 512, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.rand(1024, device=DEVICE) + 0.5
    gate, up = (torch.randn(batch, 2048, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    state = torch.zeros(4096, 2048, device=DEVICE)
    kv, score = (torch.randn(batch, 1024, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    ape, positions = torch.randn(4, 1024, device=DEVICE), torch.randint(0, 4096, (batch,), device=DEVICE)
    slots = torch.randperm(4096, device=DEVICE)[:batch]
    layout, inputs = _slots_problem(batch)
    pairs = {
        "route": lambda b: b.route(x, token_ids, router),
        "mhc weights": lambda b: b.weights(streams, fn, base, scale, 4, 20, 1e-6, 1e-6),
        "q_lora rms norm": lambda b: b.rms_norm(qr, weight, 1e-6),
        "per-head rms norm": lambda b: b.rms_norm(q, None, 1e-6),
        "shared expert swiglu": lambda b: b.swiglu(gate, up, 10.0),
        "compressor rows": lambda b: b.store_compressor_rows(state, slots, kv, score, ape, positions),
        "padded slots": lambda b: b.padded_slots(layout, inputs),
    }
    serving = {"route": (TorchMoE(), TritonMoE(reference=TorchMoE())), "mhc weights": (TorchMHC(), TritonMHC()),
               "shared expert swiglu": (TorchMoE(), TritonMoE(reference=TorchMoE()))}
    result = {}
    for name, call in pairs.items():
        reference, ours = serving.get(name, (TorchAttention(), TritonAttention()))
        result[name] = {"reference_us": round(_graph_us(lambda: call(reference)), 1),
                        "reference_launches": _launches(lambda: call(reference)),
                        "triton_us": round(_graph_us(lambda: call(ours)), 1),
                        "triton_launches": _launches(lambda: call(ours))}
    return result


if __name__ == "__main__":
    print(json.dumps({"device": torch.cuda.get_device_name(), **{f"batch {b}": cases(b) for b in (1, 64)}}, indent=1))
