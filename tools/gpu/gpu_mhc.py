"""A V4.1-Flash sublayer's mHC input on the GPU: ``TritonMHC.single_pass_input`` (V4.1) and ``sublayer_input`` (V4)
checked against the torch reference and timed, printed as JSON lines.

    PYTHONPATH=$PWD:$PWD/backends/nvidia:$PWD/tools/gpu python tools/gpu/gpu_mhc.py

Shapes: 4 streams of 5120 channels, fn [24, 20480] fp32, the input norm's weight, 20 Sinkhorn rounds; 1 and 64
tokens. Run it with another tree's plugin first on the path (``PYTHONPATH=.prev/backends/nvidia:...``) for a peer
in the same lease. A CUDA graph of calls on 16 distinct sets of weights (as a step's sublayers are) is replayed and
timed (``gpu_kernels._graph_us``), per call, programmatic dependent launch as the engine runs it.
"""

from __future__ import annotations

import json

import torch

from deepinfer.plugins.builtin.torch_mhc import TorchMHC
from deepinfer_nvidia import mhc
from deepinfer_nvidia.mhc import TritonMHC
from gpu_kernels import _graph_us

DEVICE = torch.device("cuda")
N, WIDTH, ITERS, SUBLAYERS = 4, 5120, 20, 16
EPS = 1e-6


def _weights(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    logits = (2 + N) * N
    fn = torch.randn(logits, N * WIDTH, device=DEVICE, generator=generator) * (N * WIDTH) ** -0.5
    base = torch.randn(logits, device=DEVICE, generator=generator) * 0.1
    scale = torch.rand(3, device=DEVICE, generator=generator) + 0.5
    norm = torch.rand(WIDTH, device=DEVICE, generator=generator) + 0.5
    return fn, base, scale, norm


def _call(backend, single_pass: bool, streams, previous_pre, fn, base, scale, norm):
    if single_pass:
        return backend.single_pass_input(streams, previous_pre, fn, base, scale, N, ITERS, EPS, EPS, norm, EPS)
    return backend.sublayer_input(streams, fn, base, scale, N, ITERS, EPS, EPS, norm, EPS)


def main() -> None:
    generator = torch.Generator(DEVICE).manual_seed(0)
    layers = [_weights(generator) for _ in range(SUBLAYERS)]
    triton_mhc, reference = TritonMHC(), TorchMHC()
    for tokens in (1, 64):
        streams = torch.randn(tokens, N, WIDTH, dtype=torch.bfloat16, device=DEVICE, generator=generator)
        previous_pre = torch.rand(tokens, N, device=DEVICE, generator=generator) + 0.1
        for single_pass in (True, False):
            got = _call(triton_mhc, single_pass, streams, previous_pre, *layers[0])
            want = _call(reference, single_pass, streams, previous_pre, *layers[0])
            errors = [float((g.float() - w.float()).abs().max() / w.float().abs().max())
                      for g, w in zip(got, want) if g is not None]
            graph_us = _graph_us(lambda: [_call(triton_mhc, single_pass, streams, previous_pre, *w) for w in layers])
            us = graph_us / SUBLAYERS
            print(json.dumps({"call": "single_pass_input (V4.1)" if single_pass else "sublayer_input (V4)",
                              "tokens": tokens, "us": round(us, 2), "max_err_rel": max(errors),
                              "module": mhc.__file__}), flush=True)


if __name__ == "__main__":
    main()
