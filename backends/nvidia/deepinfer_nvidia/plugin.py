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
    from deepinfer_nvidia.deepseek_kernels import deep_gemm
    from deepinfer_nvidia.fp8_linear import TritonLinear  # triton is imported only when a GPU will use it

    module, _ = deep_gemm()
    return TritonLinear(deep_gemm=module)


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
    from deepinfer_nvidia.deepseek_kernels import deep_gemm, flash_mla, report
    from deepinfer_nvidia.sparse_attention import TritonAttention

    sparse_decode, _ = flash_mla()
    fp8 = config.kv_cache_dtype == "fp8"
    serves = ("FlashMLA serves attention over the FP8 KV cache (64 or 128 heads), Triton the rest"
              if sparse_decode is not None and fp8 else
              "Triton serves attention" + (" (FlashMLA reads only kv_cache_dtype='fp8')" if sparse_decode else ""))
    gemms = "DeepGEMM serves FP8 GEMMs with 128 x 128 tiles, Triton the rest" if deep_gemm()[0] else "Triton serves GEMMs"
    log_once(logger, logging.INFO, f"DeepSeek kernels: {report()}; {serves}; {gemms}; Triton serves MoE")
    return TritonAttention(flash_mla=sparse_decode if fp8 else None)


@hookimpl
def deepinfer_mhc_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.mhc import TritonMHC

    return TritonMHC()
