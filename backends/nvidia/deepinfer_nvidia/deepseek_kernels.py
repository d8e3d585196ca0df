"""DeepSeek's own kernels (FlashMLA, DeepGEMM), loaded lazily wherever ``build.sh`` provisioned them.

Routes, in the order they are tried: a source build installs the ``flash_mla`` and ``deep_gemm`` packages; the
prebuilt route (``tools/build/fetch_kernels.py``) leaves FlashMLA's compiled extension as
``deepinfer_flashmla._flashmla_C`` and DeepGEMM's package as ``deep_gemm`` in a folder that build.sh puts on the
interpreter's path. Either way, a library that does not load is reported with the reason, never silently skipped.
FlashMLA's sparse decode reads the FP8 KV layout of ``deepinfer.runtime.fp8_kv`` (``FP8Rows.flashmla_view``), its sparse
prefill bf16 rows.
"""

from __future__ import annotations

import functools
import importlib

import torch

from deepinfer import envs

_TRITON_ONLY = "DEEPINFER_KERNELS=triton: Triton only"


def _flashmla_route(from_package, from_extension):
    """``(function, route)`` built from the ``flash_mla`` package (a source build) or else from the prebuilt
    extension's ops, or ``None`` and why neither loaded."""
    if envs.get().DEEPINFER_KERNELS == "triton":
        return None, _TRITON_ONLY
    errors = []
    try:
        import flash_mla as source_build

        return from_package(source_build), "FlashMLA (flash_mla package)"
    except Exception as exc:  # noqa: BLE001 (reported below with the other route's reason)
        errors.append(f"flash_mla: {exc}")
    try:
        importlib.import_module("deepinfer_flashmla._flashmla_C")
        return from_extension(torch.ops._flashmla_C), "FlashMLA (prebuilt extension)"
    except Exception as exc:  # noqa: BLE001
        errors.append(f"deepinfer_flashmla: {exc}")
    return None, "; ".join(errors)


@functools.cache
def flash_mla():
    """``(sparse_decode, route)``: a function with ``flash_mla_with_kvcache``'s sparse-mode arguments, or ``None``
    and why not."""
    def from_package(package):
        def sparse_decode(q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None):
            meta, _ = package.get_mla_metadata()
            return package.flash_mla_with_kvcache(
                q, kv, None, None, 512, meta, softmax_scale=scale, is_fp8_kvcache=True, indices=indices,
                attn_sink=sinks, extra_k_cache=extra_kv, extra_indices_in_kvcache=extra_indices)[0]
        return sparse_decode

    def from_extension(ops):
        def sparse_decode(q, kv, indices, sinks, scale, extra_kv=None, extra_indices=None):
            # the extension's own argument order; the tile schedule is recomputed per call (None in, ignored out)
            return ops.sparse_decode_fwd(q, kv, indices, None, sinks, None, None, extra_kv, extra_indices, None, 512,
                                         scale, None)[0]
        return sparse_decode

    return _flashmla_route(from_package, from_extension)


@functools.cache
def flash_mla_prefill():
    """``(sparse_prefill, route)``: ``sparse_prefill(q [T, H, 512], kv [rows, 1, 512], indices [T, 1, K] int32, scale,
    sinks or None) -> (out [T, H, 512], lse [T, H])`` over bf16 rows (``flash_mla_sparse_fwd``: lse in natural log,
    +inf for a query without a valid index, whose output is 0), or ``None`` and why not."""
    def from_package(package):
        fwd = package.flash_mla_sparse_fwd
        return lambda q, kv, indices, scale, sinks: fwd(q, kv, indices, scale, 512, sinks)[::2]

    def from_extension(ops):
        fwd = ops.sparse_prefill_fwd
        return lambda q, kv, indices, scale, sinks: fwd(q, kv, indices, scale, 512, sinks, None, None)[::2]

    return _flashmla_route(from_package, from_extension)


@functools.cache
def deep_gemm():
    """``(module, route)``, or ``None`` and why not."""
    if envs.get().DEEPINFER_KERNELS == "triton":
        return None, _TRITON_ONLY
    try:
        return importlib.import_module("deep_gemm"), "DeepGEMM"
    except Exception as exc:  # noqa: BLE001
        return None, f"deep_gemm: {exc}"


def grouped_bf16_gemm():
    """``(gemm, align)``: DeepGEMM's ``m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)`` and the M alignment of
    its contiguous layout, or ``(None, 0)`` where DeepGEMM did not load."""
    module, _ = deep_gemm()
    if module is None:
        return None, 0
    return module.m_grouped_bf16_gemm_nt_contiguous, module.get_mk_alignment_for_contiguous_layout()


def masked_fp8_gemm():
    """``(gemm, align)``: DeepGEMM's ``m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)``
    and the M alignment its slabs are given (the contiguous layout's), or ``(None, 0)`` where DeepGEMM did not
    load."""
    module, _ = deep_gemm()
    if module is None:
        return None, 0
    return module.m_grouped_fp8_gemm_nt_masked, module.get_mk_alignment_for_contiguous_layout()


def report() -> str:
    """One line for build.sh and the engine log: what loaded, and why the rest did not."""
    lines = []
    for name, (found, route) in (("FlashMLA", flash_mla()), ("DeepGEMM", deep_gemm())):
        lines.append(f"{name}: loaded ({route})" if found is not None else f"{name}: not loaded ({route})")
    return "; ".join(lines)
