"""Kernel-level figures of the NVIDIA backend at DeepSeek-V4-Flash shapes, printed as JSON.

    PYTHONPATH=$PWD:$PWD/backends/nvidia python tools/gpu/gpu_kernels.py [--triton-fp8 | --prefill | --grouped | --logits | --attention-splits]

- Sparse attention, decode: 64 heads x 512, a 128-row window plus 512 indexer-selected compressed entries per
  token, bf16 pools; batch 1, 16, 128 (FlashMLA's H200 time at 128 is 51.8 µs, kernel-anchors §1), with the
  bytes each call gathers and the rate that implies.
- Routed experts: 32 experts x 16 tokens each, hidden 4096, intermediate 2048 (V4-Flash), w1/w3/w2 streamed once:
  bf16 and MXFP4 weights, GB/s of weight bytes (DeepGEMM's masked FP8 grouped GEMM streams 3.59 TB/s there).
- ``--grouped``: routed experts in a prefill (512, 2048, 8192 tokens; 256 bf16 experts and 384 MXFP4 ones, top-6),
  Triton's grouped kernel against DeepGEMM's m-grouped contiguous GEMM (``moe_grouped``), and the MXFP4
  dequantization's rate.
- DeepSeek's kernels in the same run, where build.sh provisioned them (``deepseek_peers``): FlashMLA's sparse
  decode on the same attention problem, its KV packed in V4's FP8 layout (our kernel reads the same rows
  dequantized to bf16, so the outputs are compared too); DeepGEMM's masked grouped GEMM on the experts shape (FP8
  and bf16) and its FP8 GEMM against our Triton block-FP8 GEMM at projection shapes. A failing call is recorded
  with its error, not skipped.
- ``--attention-splits``: decode attention at batch 1-16 by flash-decoding split count, V4.1-Flash's shapes.
- ``--logits``: V4.1-Flash's head, fp32 logits from bf16 weights (``deepinfer_nvidia.logits``) against cuBLAS on
  an fp32 copy, at 1, 16 and 64 rows.
- ``--prefill``: sparse attention over a prefill's tokens, ours against FlashMLA's sparse prefill (bf16 rows), both
  checked against an fp32 reference, and which base FlashMLA's lse is in.
Inputs are fresh random values. Each call is captured in a CUDA graph and its replays timed (median of
triton.testing.do_bench, L2 flushed between runs), so host launch overhead is not counted, as in the engine.
"""

from __future__ import annotations

import json
import math
import os

import torch
import triton
import triton.testing

from deepinfer_nvidia import deepseek_kernels
from deepinfer_nvidia import moe_grouped
from deepinfer.runtime.fp8_kv import FP8Rows
from deepinfer.runtime.quantization import quantize_fp4, quantize_fp8
from deepinfer.plugins.interfaces import ExpertWeights
from deepinfer_nvidia.fp8_linear import fp8_linear
from deepinfer_nvidia.logits import bf16_logits
from deepinfer_nvidia.moe import TritonMoE
from deepinfer_nvidia.attention import TritonAttention

DEVICE = torch.device("cuda")
HBM_COPY_BYTES_PER_S = 4223e9  # the H200's measured copy rate (measured on the GPU box), read as the roofline


def _graph_us(fn) -> float:
    fn()  # compile and tune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay) * 1e3


def attention() -> list[dict]:
    rows = []
    heads, dim, window, selected, pool_rows = 64, 512, 128, 512, 1 << 16
    backend = TritonAttention()
    for batch in (1, 16, 128):
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=DEVICE)
        swa = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
        comp = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
        window_idx = torch.randint(0, pool_rows, (batch, window), device=DEVICE)
        comp_idx = torch.randint(0, pool_rows, (batch, selected), device=DEVICE)
        sinks = torch.randn(heads, device=DEVICE)
        sources = [(swa, window_idx), (comp, comp_idx)]
        us = _graph_us(lambda: backend.sparse_attention(q, sources, sinks, dim**-0.5))
        gathered = batch * (window + selected) * dim * 2
        flops = 2 * 2 * batch * heads * (window + selected) * dim
        rows.append({"batch": batch, "us": round(us, 1), "gathered_GBps": round(gathered / us / 1e3),
                     "TFLOPS": round(flops / us / 1e6, 1), "flashmla_h200_us_at_128": 51.8 if batch == 128 else None})
    return rows


def attention_splits() -> list[dict]:
    """Decode attention at small batches by flash-decoding split count (V4.1-Flash: 64 heads x 512, bf16 pools; a
    window-only layer and a window + 512 compressed entries one), with the count the default rule picks."""
    from deepinfer_nvidia import sparse_attention as sa

    rows = []
    heads, dim, window, selected, pool_rows = 64, 512, 128, 512, 1 << 16
    swa = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
    comp = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
    sinks = torch.randn(heads, device=DEVICE)
    for batch in (1, 2, 4, 8, 16):
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=DEVICE)
        window_idx = torch.randint(0, pool_rows, (batch, window), device=DEVICE)
        comp_idx = torch.randint(0, pool_rows, (batch, selected), device=DEVICE)
        for name, sources in (("window", [(swa, window_idx)]), ("window+512", [(swa, window_idx), (comp, comp_idx)])):
            tiles = sum(triton.cdiv(idx.shape[1], 32) for _, idx in sources)
            row = {"batch": batch, "keys": name, "default_us": round(_graph_us(
                lambda: sa.sparse_attention(q, sources, sinks, dim**-0.5)), 1)}
            for splits in sorted({1, 2, 3, 4, 5, 7, 10, 20} & set(range(1, tiles + 1))):
                row[f"splits_{splits}_us"] = round(_graph_us(
                    lambda: sa.sparse_attention(q, sources, sinks, dim**-0.5, splits=splits)), 1)
            rows.append(row)
    return rows


def _stack(experts, rows, cols, fp4):
    if not fp4:
        return torch.randn(experts, rows, cols, device=DEVICE, dtype=torch.bfloat16) * cols**-0.5, None
    packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=DEVICE) * cols**-0.5) for _ in range(experts)))
    return torch.stack(packed), torch.stack(scales)


def experts() -> list[dict]:
    rows = []
    num, per_expert, hidden, inter = 32, 16, 4096, 2048
    moe = TritonMoE(reference=None)
    for fmt in ("bf16", "mxfp4"):
        fp4 = fmt == "mxfp4"
        (w1, s1), (w3, s3), (w2, s2) = (_stack(num, inter, hidden, fp4), _stack(num, inter, hidden, fp4),
                                        _stack(num, hidden, inter, fp4))
        weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 128 if fp4 else 0)
        tokens = num * per_expert
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.arange(tokens, device=DEVICE).remainder(num).unsqueeze(1)  # 16 tokens per expert, top-1
        topk_weights = torch.rand(tokens, 1, device=DEVICE)
        us = _graph_us(lambda: moe.routed_experts(x, ids, topk_weights, weights))
        weight_bytes = sum(t.numel() * t.element_size() for t in (w1, w3, w2, s1, s3, s2) if t is not None)
        rows.append({"weights": fmt, "experts": num, "tokens_per_expert": per_expert, "us": round(us, 1),
                     "weight_GB": round(weight_bytes / 1e9, 3), "weight_GBps": round(weight_bytes / us / 1e3),
                     "deepgemm_masked_fp8_GBps_h200": 3590})
    return rows


def prefill_experts() -> list[dict]:
    """Triton's grouped kernel (16- or 64-row blocks, as it picks) against DeepGEMM's m-grouped contiguous bf16 GEMM
    (``moe_grouped``; MXFP4 experts dequantized per chunk) on prefill-sized calls, eager as a prefill runs them:
    V4-Flash's 256 bf16 experts (hidden 4096, intermediate 2048) and V4.1-Flash's 384 MXFP4 ones (5120, 2304),
    top-6. (Earlier figures had the MXFP4 experts at V4-Flash's widths.)"""
    gemm, align = deepseek_kernels.grouped_bf16_gemm()
    top_k = 6
    rows = []
    for fmt, num, hidden, inter in (("bf16", 256, 4096, 2048), ("mxfp4", 384, 5120, 2304)):
        if fmt not in os.environ.get("GROUPED_FORMATS", "bf16,mxfp4").split(","):
            continue
        fp4 = fmt == "mxfp4"
        (w1, s1), (w3, s3), (w2, s2) = (_stack(num, inter, hidden, fp4), _stack(num, inter, hidden, fp4),
                                        _stack(num, hidden, inter, fp4))
        weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 32 if fp4 else 0)  # V4.1's 1 x 32 activation blocks
        if fp4:
            us = triton.testing.do_bench(lambda: moe_grouped.dequantize_fp4_experts(w1[:32], s1[:32])) * 1e3
            written = 32 * inter * hidden * 2
            rows.append({"mxfp4_dequantization_32_experts_us": round(us), "GBps_read_plus_written":
                         round((written + written // 4 + written // 32) / us / 1e3)})
            print(json.dumps(rows[-1]), flush=True)
        for tokens in (512, 2048, 4096, 8192):
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=DEVICE)
            ids = torch.rand(tokens, num, device=DEVICE).argsort(1)[:, :top_k]
            topk_weights = torch.rand(tokens, top_k, device=DEVICE)
            flops = 2 * tokens * top_k * 3 * hidden * inter
            row = {"weights": fmt, "experts": num, "tokens": tokens}
            triton_ms = triton.testing.do_bench(lambda: TritonMoE(reference=None).routed_experts(
                x, ids, topk_weights, weights))
            row |= {"triton_ms": round(triton_ms, 2), "triton_TFLOPS": round(flops / triton_ms / 1e9)}
            if gemm is not None:
                reference = TritonMoE(reference=None).routed_experts(x, ids, topk_weights, weights).float()
                grouped = moe_grouped.routed_experts(gemm, align, x, ids, topk_weights, weights).float()
                grouped_ms = triton.testing.do_bench(lambda: moe_grouped.routed_experts(
                    gemm, align, x, ids, topk_weights, weights))
                row |= {"deepgemm_ms": round(grouped_ms, 2), "deepgemm_TFLOPS": round(flops / grouped_ms / 1e9),
                        "speedup": round(triton_ms / grouped_ms, 2),
                        "relative_difference": float((grouped - reference).norm() / reference.norm())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _attempt(fn) -> dict:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (a peer that fails is reported, the rest still run)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _fp8_pool(rows: torch.Tensor) -> FP8Rows:
    pool = FP8Rows.zeros(len(rows), rows.device)
    pool.write(torch.arange(len(rows), device=rows.device), rows)
    return pool


FP8_DECODE = dict(heads=64, dim=512, window=128, selected=512, pool_rows=1 << 16)


def _fp8_decode_problem(batch: int):
    """V4-Flash decode attention over FP8 rows: window and compressed pools, queries [B, H, D], index lists
    (int64) into each, sinks and the softmax scale."""
    heads, dim, rows = FP8_DECODE["heads"], FP8_DECODE["dim"], FP8_DECODE["pool_rows"]
    swa, comp = (_fp8_pool(torch.randn(rows, dim, device=DEVICE).to(torch.bfloat16)) for _ in range(2))
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=DEVICE)
    window_idx, comp_idx = (torch.randint(0, rows, (batch, FP8_DECODE[k]), device=DEVICE)
                            for k in ("window", "selected"))
    return swa, comp, q, window_idx, comp_idx, torch.randn(heads, device=DEVICE), dim**-0.5


def flashmla_peer() -> list[dict]:
    """FlashMLA and our kernel on the same FP8 cache (ours reads it dequantized to bf16 here; ``--triton-fp8``
    times it reading the FP8 rows)."""
    sparse_decode, route = deepseek_kernels.flash_mla()
    if sparse_decode is None:
        return [{"error": route}]
    rows = []
    backend = TritonAttention()
    for batch in (1, 16, 128):
        def one() -> dict:
            swa, comp, q, window_idx, comp_idx, sinks, scale = _fp8_decode_problem(batch)
            args = (q.unsqueeze(1), comp.flashmla_view(), comp_idx.int().unsqueeze(1), sinks, scale,
                    swa.flashmla_view(), window_idx.int().unsqueeze(1))
            theirs = sparse_decode(*args)[:, 0]
            flashmla_us = _graph_us(lambda: sparse_decode(*args))
            everything = torch.arange(FP8_DECODE["pool_rows"], device=DEVICE)
            sources = [(swa[everything], window_idx), (comp[everything], comp_idx)]
            ours = backend.sparse_attention(q, sources, sinks, scale)
            ours_us = _graph_us(lambda: backend.sparse_attention(q, sources, sinks, scale))
            diff = (ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()
            return {"batch": batch, "flashmla_us": round(flashmla_us, 1), "triton_bf16_us": round(ours_us, 1),
                    "triton_over_flashmla": round(ours_us / flashmla_us, 2), "max_diff_rel": float(diff)}
        rows.append(_attempt(one))
    return rows


def deepgemm_peer() -> list[dict]:
    dg, route = deepseek_kernels.deep_gemm()
    if dg is None:
        return [{"error": route}]
    from deep_gemm.utils import per_block_cast_to_fp8, per_token_cast_to_fp8

    rows = []
    num, m, hidden, inter = 32, 16, 4096, 2048
    for n, k in ((2 * inter, hidden), (hidden, inter)):  # w1|w3 fused, then w2: the experts' bytes of one layer
        def masked(fp8: bool) -> dict:
            # the masked layout holds max_m rows per expert, aligned to DeepGEMM's block; `counts` say how many count
            max_m = 128
            a = torch.randn(num, max_m, k, device=DEVICE, dtype=torch.bfloat16)
            b = torch.randn(num, n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
            d = torch.empty(num, max_m, n, device=DEVICE, dtype=torch.bfloat16)
            counts = torch.full((num,), m, device=DEVICE, dtype=torch.int32)
            if fp8:
                qa = [per_token_cast_to_fp8(a[e], use_ue8m0=False) for e in range(num)]
                qb = [per_block_cast_to_fp8(b[e], use_ue8m0=False) for e in range(num)]
                lhs = (torch.stack([x for x, _ in qa]), torch.stack([s for _, s in qa]))
                rhs = (torch.stack([x for x, _ in qb]), torch.stack([s for _, s in qb]))
                call = lambda: dg.m_grouped_fp8_gemm_nt_masked(lhs, rhs, d, counts, m)  # noqa: E731
                weight_bytes = num * n * k
            else:
                call = lambda: dg.m_grouped_bf16_gemm_nt_masked(a, b, d, counts, m)  # noqa: E731
                weight_bytes = num * n * k * 2
            us = _graph_us(call)
            d, a = d[:, :m], a[:, :m]
            diff = (d.float() - torch.bmm(a.float(), b.float().transpose(1, 2))).abs().max() / d.float().abs().max()
            return {"kernel": f"m_grouped_{'fp8' if fp8 else 'bf16'}_gemm_nt_masked", "experts": num,
                    "tokens_per_expert": m, "n": n, "k": k, "us": round(us, 1),
                    "weight_GBps": round(weight_bytes / us / 1e3), "max_diff_rel": round(float(diff), 4)}
        rows += [_attempt(lambda: masked(True)), _attempt(lambda: masked(False))]
    for tokens in (1, 16, 64):  # a 4096 x 4096 FP8 projection, 128 x 128 weight tiles: DeepGEMM against ours
        def dense() -> dict:
            x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
            weight, scale = quantize_fp8(torch.randn(hidden, hidden, device=DEVICE) * hidden**-0.5, 128, 128)
            lhs = per_token_cast_to_fp8(x, use_ue8m0=False)
            out = torch.empty(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
            theirs_us = _graph_us(lambda: dg.fp8_gemm_nt(lhs, (weight, scale.float()), out))
            ours_us = _graph_us(lambda: fp8_linear(x, weight, scale, 128))
            diff = (fp8_linear(x, weight, scale, 128).float() - out.float()).abs().max() / out.float().abs().max()
            return {"kernel": "fp8_gemm_nt", "m": tokens, "n": hidden, "k": hidden, "deepgemm_us": round(theirs_us, 1),
                    "triton_us": round(ours_us, 1), "triton_over_deepgemm": round(ours_us / theirs_us, 2),
                    "max_diff_rel": round(float(diff), 4)}
        rows.append(_attempt(dense))
    return rows


def triton_fp8_attention() -> list[dict]:
    """Our kernel reading the FP8 rows itself (the layout FlashMLA reads), on flashmla_peer's problem. Run alone
    (``--triton-fp8``): this path has faulted natively in padded decode steps, and a fault ends the
    process."""
    rows = []
    backend = TritonAttention()
    for batch in (1, 16, 128):
        def one() -> dict:
            swa, comp, q, window_idx, comp_idx, sinks, scale = _fp8_decode_problem(batch)
            sources = [(swa, window_idx), (comp, comp_idx)]
            us = _graph_us(lambda: backend.sparse_attention(q, sources, sinks, scale))
            return {"batch": batch, "triton_fp8_us": round(us, 1)}
        rows.append(_attempt(one))
    return rows


def _reference_attention(q, kv, idx, sinks, scale):
    """fp32 sparse attention over one bf16 pool: outputs [T, H, D] with sinks, and the natural-log lse [T, H]."""
    rows = kv[idx.clamp(min=0)].float()  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("thk,tkd->thd", torch.softmax(logits, dim=-1), rows)
    return out * torch.sigmoid(lse - sinks)[..., None], lse


def flashmla_prefill_peer() -> list[dict]:
    """Sparse attention over a prefill's tokens (64 heads x 512, 128 window + 512 selected rows each, bf16): ours
    against FlashMLA's ``sparse_prefill_fwd`` on one pool, both against an fp32 reference; and the base of
    FlashMLA's lse (natural or 2), found by comparing it with the reference's (what merging two pools' partial
    results needs)."""
    heads, dim, pool_rows, scale = 64, 512, 1 << 16, 512**-0.5
    call, route = deepseek_kernels.flash_mla_prefill()
    if call is None:
        return [{"error": route}]
    backend = TritonAttention()
    rows = []
    for tokens in (512, 4096):
        def one() -> dict:
            q = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device=DEVICE)
            kv = torch.randn(pool_rows, dim, dtype=torch.bfloat16, device=DEVICE)
            idx = torch.randint(0, pool_rows, (tokens, 640), device=DEVICE)
            idx[:, -37:] = -1  # invalid entries, as a short prompt's lists have
            idx[0] = -1  # a token with no valid entry (an early token's compressed list): compared apart
            sinks = torch.randn(heads, device=DEVICE)
            ref, ref_lse = _reference_attention(q[1:], kv, idx[1:], sinks, scale)
            idx32 = idx.int().unsqueeze(1)
            out, lse = call(q, kv.unsqueeze(1), idx32, scale, sinks)
            ours = backend.sparse_attention(q, [(kv, idx)], sinks, scale)
            empty = {"out_absmax": float(out[0].float().abs().max()), "lse": lse[0, :2].tolist(),
                     "triton_out_absmax": float(ours[0].float().abs().max())}
            out, lse, ours = out[1:], lse[1:], ours[1:]
            peak = ref.abs().max()
            return {"tokens": tokens, "token_without_entries": empty,
                    "flashmla_us": round(_graph_us(lambda: call(q, kv.unsqueeze(1), idx32, scale, sinks)), 1),
                    "triton_us": round(_graph_us(lambda: backend.sparse_attention(q, [(kv, idx)], sinks, scale)), 1),
                    "flashmla_err_rel": float((out.float() - ref).abs().max() / peak),
                    "triton_err_rel": float((ours.float() - ref).abs().max() / peak),
                    "lse_vs_natural": float((lse.float() - ref_lse).abs().max()),
                    "lse_vs_base2": float((lse.float() - ref_lse / math.log(2)).abs().max())}
        rows.append(_attempt(one))
    return rows


def head_logits() -> list[dict]:
    """V4.1-Flash's vocabulary projection (129280 x 5120): fp32 logits from the bf16 head (``bf16_logits``) against
    cuBLAS on an fp32 copy (what the engine ran before) and cuBLAS in bf16 (bf16 logits: a speed reference only),
    each checked against an fp64 product, with the bf16 head's read at the copy rate as the roofline."""
    vocab, width, rows_out = 129280, 5120, []
    weight = (torch.randn(vocab, width, device=DEVICE) * width**-0.5).to(torch.bfloat16)
    weight32 = weight.float()
    for rows in (1, 16, 64):
        hidden = torch.randn(rows, width, device=DEVICE) * 3
        exact = hidden.double() @ weight32.double().T
        peak = exact.abs().max()
        row = {"rows": rows, "roofline_us": round(weight.numel() * 2 / HBM_COPY_BYTES_PER_S * 1e6, 1)}
        for name, call in (("bf16_logits", lambda: bf16_logits(hidden, weight)),
                           ("cublas_fp32", lambda: hidden @ weight32.T),
                           ("cublas_bf16", lambda: hidden.to(torch.bfloat16) @ weight.T)):
            row[f"{name}_us"] = round(_graph_us(call), 1)
            row[f"{name}_err_rel"] = float((call().double() - exact).abs().max() / peak)
        rows_out.append(row)
    return rows_out


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--attention-splits"]:
        print(json.dumps({"attention_splits": attention_splits()}))
    elif sys.argv[1:] == ["--logits"]:
        print(json.dumps({"head_logits": head_logits()}, indent=1))
    elif sys.argv[1:] == ["--grouped"]:
        print(json.dumps({"prefill_experts": prefill_experts()}, indent=1))
    elif sys.argv[1:] == ["--prefill"]:
        print(json.dumps({"flashmla_prefill": flashmla_prefill_peer()}, indent=1))
    elif sys.argv[1:] == ["--triton-fp8"]:
        print(json.dumps({"triton_fp8_attention": triton_fp8_attention()}, indent=1))
    else:
        print(json.dumps({"device": torch.cuda.get_device_name(), "deepseek_kernels": deepseek_kernels.report(),
                          "attention": attention(), "flashmla": flashmla_peer(), "experts": experts(),
                          "deepgemm": deepgemm_peer()}, indent=1))
