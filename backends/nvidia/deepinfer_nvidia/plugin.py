"""Hook implementations: each answers only for CUDA devices, so on any other device the built-ins serve.

With ``DEEPINFER_BATCH_INVARIANT=1`` every kernel keeps one configuration whatever the batch: attention splits
cover a fixed number of key tiles, the FP8 GEMM and the MXFP4 experts use pinned tiles, and FlashMLA and DeepGEMM
(whose schedules follow the batch) are left unused.
"""

from __future__ import annotations

import logging

from deepinfer.logger import init_logger, log_once
from deepinfer.plugins import hookimpl

logger = init_logger(__name__)

# Asked before feature plugins (manager.PRIORITY_ATTRIBUTE): with DEEPINFER_BATCH_INVARIANT=1 this plugin serves
# its own invariant kernels on CUDA, where features/batch_invariant's attention would run the CPU-style blocked one
DEEPINFER_PRIORITY = 10

# Batch-invariant attention: key tiles per split (256 keys of 512-wide bf16 rows). Larger splits leave small
# decode batches fewer programs; smaller ones write more partial rows.
INVARIANT_TILES_PER_SPLIT = 8


def _invariant(config) -> bool:
    return config.batch_invariant


@hookimpl
def deepinfer_linear_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.deepseek_kernels import deep_gemm
    from deepinfer_nvidia.fp8_linear import TritonLinear  # triton is imported only when a GPU will use it

    if _invariant(config):
        return TritonLinear(pinned=True)
    module, _ = deep_gemm()
    return TritonLinear(deep_gemm=module)


def _masked_fp8_experts(device) -> bool:
    """Whether DeepGEMM's masked grouped GEMM takes FP8 experts at decode: on SM100, its first target. On the H200
    (SM90) Triton's grouped kernel streams the same experts 1.2-2.4x faster (BENCHMARKS.md), so it serves them."""
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 10


@hookimpl
def deepinfer_moe_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer_nvidia.deepseek_kernels import grouped_bf16_gemm, masked_fp8_gemm
    from deepinfer_nvidia import moe_humming
    from deepinfer_nvidia.moe import TritonMoE

    if _invariant(config):
        return TritonMoE(reference=TorchMoE(), pinned=True)
    gemm, align = grouped_bf16_gemm()
    masked, masked_align = masked_fp8_gemm() if _masked_fp8_experts(device) else (None, 0)
    humming, route = moe_humming.load()
    log_once(logger, logging.INFO, f"MXFP4 experts: {route if humming is not None else 'Triton (' + route + ')'}")
    return TritonMoE(reference=TorchMoE(), grouped_gemm=gemm, grouped_align=align, masked_gemm=masked,
                     masked_align=masked_align, humming=humming is not None)


@hookimpl
def deepinfer_attention_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.deepseek_kernels import deep_gemm, flash_mla, flash_mla_prefill, report
    from deepinfer_nvidia.attention import FLASHMLA_PREFILL_MIN_TOKENS, TritonAttention

    if _invariant(config):
        log_once(logger, logging.INFO, f"DeepSeek kernels: {report()}; batch-invariant mode: Triton serves "
                                       "attention, GEMMs and MoE with fixed configurations")
        return TritonAttention(tiles_per_split=INVARIANT_TILES_PER_SPLIT)
    (sparse_decode, _), (sparse_prefill, _) = flash_mla(), flash_mla_prefill()
    fp8 = config.kv_cache_dtype == "fp8"
    if sparse_decode is not None and fp8:
        serves = "FlashMLA serves attention over the FP8 KV cache (64 or 128 heads), Triton the rest"
    elif sparse_prefill is not None and not fp8:
        serves = (f"FlashMLA's sparse prefill serves attention over bf16 rows in calls of "
                  f"{FLASHMLA_PREFILL_MIN_TOKENS}+ tokens (64 or 128 heads), Triton the rest")
    else:
        serves = "Triton serves attention"
    if deep_gemm()[0] is not None:
        masked = " and FP8 experts at decode" if _masked_fp8_experts(device) else ""
        gemms = (f"DeepGEMM serves FP8 GEMMs with 128 x 128 tiles{masked}, and the routed experts of long prefills "
                 "(bf16, MXFP4 dequantized), Triton the rest")
    else:
        gemms = "Triton serves GEMMs and MoE"
    log_once(logger, logging.INFO, f"DeepSeek kernels: {report()}; {serves}; {gemms}")
    return TritonAttention(flash_mla=sparse_decode if fp8 else None, flash_mla_prefill=None if fp8 else sparse_prefill)


@hookimpl
def deepinfer_vision_attention_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.vision_attention import SDPAVisionAttention

    return SDPAVisionAttention()


@hookimpl
def deepinfer_sampler(config, device):
    if device.type != "cuda":
        return None
    from deepinfer.plugins.builtin.torch_sampler import TorchSampler
    from deepinfer_nvidia.sampling import greedy_tokens

    return TorchSampler(name="torch-reference, Triton argmax", greedy=greedy_tokens)


@hookimpl
def deepinfer_mhc_backend(config, device):
    if device.type != "cuda":
        return None
    from deepinfer_nvidia.mhc import GEMM_TOKENS, TritonMHC

    return TritonMHC(gemm_tokens=None if _invariant(config) else GEMM_TOKENS)
