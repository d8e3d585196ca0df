"""Hook implementations: each answers only for CUDA devices, so on any other device the built-ins serve."""

from __future__ import annotations

import logging

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins import hookimpl

logger = init_logger(__name__)


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
    from deepinfer_nvidia.deepseek_kernels import report
    from deepinfer_nvidia.sparse_attention import TritonAttention

    # FlashMLA's sparse decode reads the FP8 (584-byte) KV layout, which the engine's caches do not use yet; its
    # kernel is measured side by side (tools/gpu_kernels.py) until then
    log_once(logger, logging.INFO, f"DeepSeek kernels: {report()}; Triton serves attention, MoE and GEMMs")
    return TritonAttention()


@hookimpl
def deepinfer_mhc_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.mhc import TritonMHC

    return TritonMHC()
