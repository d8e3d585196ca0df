"""DeepSeek's own kernels (FlashMLA, DeepGEMM), loaded lazily wherever ``build.sh`` provisioned them.

Routes, in the order they are tried: a source build installs the ``flash_mla`` and ``deep_gemm`` packages; the
prebuilt route (``tools/fetch_kernels.py``) leaves FlashMLA's compiled extension as
``deepinfer_flashmla._flashmla_C`` and DeepGEMM's package as ``deep_gemm`` in a folder that build.sh puts on the
interpreter's path. Either way, a library that does not load is reported with the reason, never silently skipped.

Also here: V4's FP8 KV layout for FlashMLA's sparse decode ("MODEL1", from FlashMLA's ``tests/quant.py``). A token's
512-dim row is 448 NoPE channels in e4m3 with one power-of-two (UE8M0) scale per 64, plus 64 RoPE channels kept in
bf16: 584 bytes. Within a page of ``page`` tokens the 576-byte [NoPE | RoPE] rows come first, then the 8-byte
[7 scales | pad] rows; a page's buffer is padded to a multiple of 576 bytes. The kernel reads a page-major
``[pages, page, 1, 584]`` view whose token stride is 584.
"""

from __future__ import annotations

import functools
import importlib

import torch

D_NOPE, D_ROPE, TILE = 448, 64, 64
ROW_BYTES = D_NOPE + 2 * D_ROPE  # 576
SCALE_BYTES = D_NOPE // TILE + 1  # 7 exponents and a pad byte
TOKEN_BYTES = ROW_BYTES + SCALE_BYTES  # 584
FP8_MAX = 448.0


@functools.cache
def flash_mla():
    """``(sparse_decode, route)``: a function with ``flash_mla_with_kvcache``'s sparse-mode arguments, or ``None``
    and why not."""
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


def pack_kv(rows: torch.Tensor, page: int) -> torch.Tensor:
    """``rows`` [tokens, 512] (bf16; tokens a multiple of ``page``) -> the MODEL1 cache ``[pages, page, 1, 584]``
    (an e4m3 view of the bytes, as FlashMLA takes it), token ``t`` in page ``t // page``."""
    tokens, dim = rows.shape
    if dim != D_NOPE + D_ROPE or tokens % page:
        raise ValueError(f"pack_kv takes [pages * {page}, 512] rows, got {list(rows.shape)}")
    pages = tokens // page
    padded = -(-page * TOKEN_BYTES // ROW_BYTES) * ROW_BYTES
    buffer = torch.zeros(pages, padded, dtype=torch.uint8, device=rows.device)
    nope = rows[:, :D_NOPE].float().unflatten(-1, (-1, TILE))  # [tokens, 7, 64]
    # the smallest power of two that brings the tile's largest magnitude within e4m3's range (1e-4 floor: zeros)
    scale = torch.exp2(torch.ceil(torch.log2((nope.abs().amax(-1) / FP8_MAX).clamp_min(1e-4))))
    quantized = (nope / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(1).view(torch.uint8)
    rope = rows[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)  # [tokens, 128]
    body = buffer[:, : page * ROW_BYTES].view(pages, page, ROW_BYTES)
    body[..., :D_NOPE] = quantized.view(pages, page, D_NOPE)
    body[..., D_NOPE:] = rope.view(pages, page, 2 * D_ROPE)
    exponents = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)  # UE8M0: the biased exponent
    tail = buffer[:, page * ROW_BYTES : page * TOKEN_BYTES].view(pages, page, SCALE_BYTES)
    tail[..., : SCALE_BYTES - 1] = exponents.view(pages, page, -1)
    return buffer.view(torch.float8_e4m3fn).as_strided((pages, page, 1, TOKEN_BYTES), (padded, TOKEN_BYTES, TOKEN_BYTES, 1))


def unpack_kv(cache: torch.Tensor) -> torch.Tensor:
    """The bf16 rows [pages * page, 512] a MODEL1 cache holds (what the kernel attends to)."""
    pages, page = cache.shape[:2]
    flat = cache.view(torch.uint8).as_strided((pages, cache.stride(0)), (cache.stride(0), 1))
    body = flat[:, : page * ROW_BYTES].reshape(pages, page, ROW_BYTES)
    nope = body[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, TILE))
    rope = body[..., D_NOPE:].contiguous().view(torch.bfloat16)
    exponents = flat[:, page * ROW_BYTES : page * TOKEN_BYTES].reshape(pages, page, SCALE_BYTES)[..., :-1]
    scale = torch.exp2(exponents.float() - 127).unsqueeze(-1)
    rows = torch.cat(((nope * scale).flatten(-2).to(torch.bfloat16), rope), dim=-1)
    return rows.reshape(pages * page, D_NOPE + D_ROPE)
