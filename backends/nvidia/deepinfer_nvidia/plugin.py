"""Hook implementations: each answers only for CUDA devices, so on any other device the built-ins serve."""

from __future__ import annotations

from deepinfer.plugins import hookimpl


@hookimpl
def deepinfer_linear_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.fp8_linear import TritonLinear  # triton is imported only when a GPU will use it

    return TritonLinear()


@hookimpl
def deepinfer_moe_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer_nvidia.moe import TritonMoE

    return TritonMoE(reference=TorchMoE())


@hookimpl
def deepinfer_attention_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.sparse_attention import TritonAttention

    return TritonAttention()


@hookimpl
def deepinfer_mhc_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.mhc import TritonMHC

    return TritonMHC()
