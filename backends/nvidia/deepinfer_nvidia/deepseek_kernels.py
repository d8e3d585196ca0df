"""DeepSeek's own kernels (FlashMLA, DeepGEMM), loaded lazily wherever ``build.sh`` provisioned them.

Routes, in the order they are tried: a source build installs the ``flash_mla`` and ``deep_gemm`` packages; the
prebuilt route (``tools/fetch_kernels.py``) leaves FlashMLA's compiled extension as
``deepinfer_flashmla._flashmla_C`` and DeepGEMM's package as ``deep_gemm`` in a folder that build.sh puts on the
interpreter's path. Either way, a library that does not load is reported with the reason, never silently skipped.
FlashMLA's sparse decode reads the FP8 KV layout of ``deepinfer.core.fp8_kv`` (``FP8Rows.flashmla_view``).
"""

from __future__ import annotations

import functools
import importlib

import torch

from deepinfer import envs

_TRITON_ONLY = "DEEPINFER_KERNELS=triton: Triton only"


@functools.cache
def flash_mla():
    """``(sparse_decode, route)``: a function with ``flash_mla_with_kvcache``'s sparse-mode arguments, or ``None``
    and why not."""
    if envs.get().DEEPINFER_KERNELS == "triton":
        return None, _TRITON_ONLY
    errors = []
    try:
        import flash_mla as source_build

        def sparse_decode(q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None):
            meta, _ = source_build.get_mla_metadata()
            return source_build.flash_mla_with_kvcache(
                q, kv, None, None, 512, meta, softmax_scale=scale, is_fp8_kvcache=True, indices=indices,
                attn_sink=sinks, extra_k_cache=extra_kv, extra_indices_in_kvcache=extra_indices)[0]

        return sparse_decode, "FlashMLA (flash_mla package)"
    except Exception as exc:  # noqa: BLE001 (reported below with the other route's reason)
        errors.append(f"flash_mla: {exc}")
    try:
        importlib.import_module("deepinfer_flashmla._flashmla_C")
        ops = torch.ops._flashmla_C

        def sparse_decode(q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None):
            # the extension's own argument order; the tile schedule is recomputed per call (None in, ignored out)
            return ops.sparse_decode_fwd(q, kv, indices, None, sinks, None, None, extra_kv, extra_indices, None, 512,
                                         scale, None)[0]

        return sparse_decode, "FlashMLA (prebuilt extension)"
    except Exception as exc:  # noqa: BLE001
        errors.append(f"deepinfer_flashmla: {exc}")
    return None, "; ".join(errors)


@functools.cache
def deep_gemm():
    """``(module, route)``, or ``None`` and why not."""
    if envs.get().DEEPINFER_KERNELS == "triton":
        return None, _TRITON_ONLY
    try:
        return importlib.import_module("deep_gemm"), "DeepGEMM"
    except Exception as exc:  # noqa: BLE001
        return None, f"deep_gemm: {exc}"


def report() -> str:
    """One line for build.sh and the engine log: what loaded, and why the rest did not."""
    lines = []
    for name, (found, route) in (("FlashMLA", flash_mla()), ("DeepGEMM", deep_gemm())):
        lines.append(f"{name}: loaded ({route})" if found is not None else f"{name}: not loaded ({route})")
    return "; ".join(lines)
