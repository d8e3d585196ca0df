"""Peer MXFP4 MoE kernels for ``tools/gpu/gpu_mxfp4.py --peers`` (issue 39): the same routed-expert problem run
through `humming-kernels` 0.1.19 and OpenAI's `triton_kernels` (triton v3.6-era ``matmul_ogs``).

Each ``prepare_*`` converts our standard MXFP4 stacks ONCE into the peer's format and returns either a callable
``run() -> bf16 [T, hidden]`` (both projections, SwiGLU, top-k weighted sum) or a reason string (package
missing, import or conversion failed): a peer never makes the benchmark raise.

Our format (``deepinfer.runtime.quantization.quantize_fp4``): ``w1``/``w3`` [E, I, H/2] and ``w2`` [E, H, I/2] int8,
two e2m1 codes per byte, the even column in the low nibble; e8m0 scales [E, N, K/32] (uint8 or
``float8_e8m0fnu``), one per 1 x 32 row segment. Our SwiGLU is ``silu(min(gate, limit)) * clamp(up, -limit,
limit)`` in fp32, and our reference rounds both GEMMs' activations to FP8 in 1 x 32 blocks.

Both peers here are W4A16: activations stay bf16 (no FP8 rounding). Their error against our torch reference
therefore includes the FP8 activation rounding of the reference (~1e-2 relative); ``--check`` also reports the
error against a W4A16 torch reference (same weights, bf16 activations, same SwiGLU), which is the
like-for-like correctness number.

Run ``python tools/gpu/mxfp4_peers.py --check`` on the GPU box (after ``bash .peers/install.sh``) for one small
problem per peer, one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS_DIR = os.path.join(ROOT, ".peers")
TRITON_KERNELS_DIR = os.path.join(PEERS_DIR, "triton_kernels")  # holds the triton_kernels package

HUMMING_NAME = "humming-kernels 0.1.19 W4A16 (INDEXED MoE GEMMs, torch SwiGLU + top-k sum)"
TRITON_KERNELS_NAME = "triton_kernels v3.6.0 matmul_ogs (Hopper MX layouts, fused SwiGLU, fused top-k scatter)"

Runner = Callable[[], torch.Tensor]


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def swiglu_fp32(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Our SwiGLU variant, fp32: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate.float(), up.float()
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def reference_w4a16(x, topk_ids, topk_weights, w1, w3, w2, s1, s3, s2, limit) -> torch.Tensor:
    """The routed MoE with bf16 (unrounded) activations: what a W4A16 peer should match up to summation order
    and the bf16 intermediate. Loops over touched experts (slow; for checks only)."""
    from deepinfer.runtime.quantization import dequantize_fp4

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        tokens, slots = torch.where(topk_ids == e)
        rows = x[tokens].float()
        gate = rows @ dequantize_fp4(w1[e], s1[e], torch.float32).T
        up = rows @ dequantize_fp4(w3[e], s3[e], torch.float32).T
        h = swiglu_fp32(gate, up, limit).to(torch.bfloat16).float()
        y = h @ dequantize_fp4(w2[e], s2[e], torch.float32).T
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(-1))
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# OpenAI triton_kernels (v3.6-era API: matmul_ogs, RoutingData + GatherIndx/ScatterIndx, RaggedTensorMetadata)
# --------------------------------------------------------------------------------------------------------------

def _import_triton_kernels():
    if os.path.isdir(TRITON_KERNELS_DIR) and TRITON_KERNELS_DIR not in sys.path:
        sys.path.insert(0, TRITON_KERNELS_DIR)
    import triton_kernels  # noqa: F401
    if not os.path.exists(os.path.join(os.path.dirname(triton_kernels.__file__), "matmul_ogs.py")):
        raise ImportError(f"triton_kernels at {triton_kernels.__file__} has no matmul_ogs (not the 3.6-era tree; "
                          "the PyPI package named triton-kernels is unrelated)")
    import triton_kernels.matmul_ogs as mo
    return mo


def triton_kernels_weights(w: torch.Tensor, s: torch.Tensor, hopper: bool):
    """One projection [E, N, K/2] int8 + [E, N, K/32] e8m0 -> (triton_kernels value Tensor, scale Tensor).

    triton_kernels wants the weight as [E, K, N] with the MX axis (K) at dim 1: the bytes [E, N, K/2] are
    transposed to [E, K/2, N] (a view; ``wrap_torch_tensor(dtype=FP4)`` reads it as [E, K, N]) and the scales to
    [E, K/32, N] uint8. Nibble order is the same as ours (low nibble = even K index; see
    ``numerics_details.mxfp.upcast_from_mxfp_torch``), e8m0 bytes are used as-is. On Hopper both are then
    swizzled once into ``HopperMXValueLayout(mx_axis=1)`` (4-value bit twiddle for the 14-SASS bf16 upcast)
    and ``HopperMXScaleLayout(mx_axis=1, num_warps=8)``; elsewhere they stay strided.
    """
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    value = wrap_torch_tensor(_u8(w).transpose(-2, -1), dtype=FP4)
    scale = wrap_torch_tensor(_u8(s).transpose(-2, -1))
    if hopper:
        value = convert_layout(value, HopperMXValueLayout, mx_axis=1)
        scale = convert_layout(scale, HopperMXScaleLayout, mx_axis=1, num_warps=8)
    return value, scale


def interleave_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[E, N, X] x2 -> [E, 2N, X] with row 2j = a[j], 2j + 1 = b[j] (triton_kernels' fused SwiGLU reads the GEMM
    output as (gate, up) pairs of adjacent columns)."""
    return torch.stack((a, b), dim=2).flatten(1, 2)


def triton_kernels_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: int):
    """RoutingData / GatherIndx / ScatterIndx from our top-k table, in torch (graph-capturable: no host sync).

    Rows of the expanded problem are the T*k (token, slot) pairs; ``order`` sorts them by expert (stable), so
    ``gather.src_indx = order`` (expert-sorted row -> flat pair) and ``gather.dst_indx`` its inverse, as vLLM's
    3.6 path builds them from the bitmatrix metadata (col_sorted_indx / row_sorted_indx)."""
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
    from triton_kernels.tensor_details.ragged_tensor import make_ragged_tensor_metadata

    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    hist = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    hist.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ragged = make_ragged_tensor_metadata(hist, tokens * k)
    gate_scal = topk_weights.reshape(-1).to(torch.float32)[order]
    routing = RoutingData(gate_scal, hist, experts, k, ragged)
    combine, dispatch = order.to(torch.int32), inverse.to(torch.int32)
    return routing, GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine)


_SWIGLU_FN = None


def _deepinfer_swiglu_fn():
    """Our SwiGLU as a triton_kernels fused activation (theirs is the gpt-oss variant
    ``gate * sigmoid(alpha * gate) * (up + 1)``, which differs by the ``+ 1``): min/clamp then silu * up, fp32."""
    global _SWIGLU_FN
    if _SWIGLU_FN is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _swiglu_deepinfer(acc, limit):
            pairs = tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2))
            gate, up = tl.split(pairs)
            gate = tl.minimum(gate.to(tl.float32), limit)
            up = tl.clamp(up.to(tl.float32), -limit, limit)
            return gate / (1.0 + tl.exp(-gate)) * up

        _SWIGLU_FN = _swiglu_deepinfer
    return _SWIGLU_FN


def prepare_triton_kernels(x, topk_ids, topk_weights, w1, w3, w2, s1, s3, s2, limit) -> Runner | str:
    """triton_kernels peer: one matmul_ogs for w1|w3 (gathered rows, fused SwiGLU), one for w2 (fused
    top-k weighted scatter-sum). CUDA-graph capturable (routing tensors are built before capture; both launches
    are device-only). Split-K is pinned to 1 on Hopper, as vLLM does."""
    try:
        mo = _import_triton_kernels()
        from triton_kernels.matmul_ogs_details import opt_flags
        from triton_kernels.numerics import InFlexData
        from triton_kernels.specialize import FnSpecs
    except Exception as exc:  # noqa: BLE001
        return f"triton_kernels unavailable: {_reason(exc)}"
    try:
        hopper = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
        if hopper:
            opt_flags.update_opt_flags_constraints({"split_k": 1})
        experts, inter = w1.shape[0], w1.shape[1]
        tokens, k = topk_ids.shape
        w13, s13 = triton_kernels_weights(interleave_rows(w1, w3), interleave_rows(_u8(s1), _u8(s3)), hopper)
        w2t, s2t = triton_kernels_weights(w2, s2, hopper)
        flex = mo.FlexCtx(rhs_data=InFlexData())
        pc13 = mo.PrecisionConfig(weight_scale=s13, flex_ctx=flex)
        pc2 = mo.PrecisionConfig(weight_scale=s2t, flex_ctx=flex)
        activation = mo.FusedActivation(FnSpecs("deepinfer_swiglu", _deepinfer_swiglu_fn(), ("limit",),
                                                reduction_n=2), (float(limit),))
        routing, gather, scatter = triton_kernels_routing(topk_ids, topk_weights, experts)
        h = torch.empty(1, tokens * k, inter, dtype=torch.bfloat16, device=x.device)
        out = torch.empty(1, tokens, x.shape[1], dtype=torch.bfloat16, device=x.device)

        def run() -> torch.Tensor:
            mo.matmul_ogs(x, w13, None, routing, gather_indx=gather, precision_config=pc13,
                          fused_activation=activation, y=h)
            mo.matmul_ogs(h.view(tokens * k, inter), w2t, None, routing, scatter_indx=scatter,
                          precision_config=pc2, gammas=routing.gate_scal, y=out)
            return out.view(tokens, -1)

        return run
    except Exception as exc:  # noqa: BLE001
        return f"triton_kernels conversion failed: {_reason(exc)}"


# --------------------------------------------------------------------------------------------------------------
# humming-kernels 0.1.19
# --------------------------------------------------------------------------------------------------------------

def humming_layer(w: torch.Tensor, s: torch.Tensor):
    """One projection as a ``humming.layer.HummingLayer`` with the ``mxfp4`` weight schema.

    ``Mxfp4WeightSchema`` takes exactly our checkpoint layout: ``weight`` [E, N, K/2] uint8 (two e2m1 codes per
    byte, low nibble first, DeepSeek/OCP order) and ``weight_scale`` [E, N, K/32] uint8 e8m0, group 32. For w1|w3
    we concatenate along N (rows [0, I) gate, [I, 2I) up: one GEMM, split afterwards). ``transform()`` repacks
    once for the kernel (N padded to 256, K to 128, as vLLM 0.33 does; V4.1's shapes need no padding)."""
    from humming.layer import HummingLayer
    from humming.schema import Mxfp4WeightSchema

    experts, n, half_k = w.shape
    layer = HummingLayer(shape_n=n, shape_k=2 * half_k, weight_config=Mxfp4WeightSchema(), num_experts=experts,
                         pad_n_to_multiple=256, pad_k_to_multiple=128, torch_dtype=torch.bfloat16)
    layer.load_from_tensors({"weight": _u8(w), "weight_scale": _u8(s)})
    layer = layer.to(w.device)
    layer.transform()
    return layer


def _humming_block_m(tuning, rows: int, default: int = 64) -> int:
    for low, high, cfg in tuning:
        if low < rows <= high:
            return int(cfg["block_shape"][0])
    return default


def humming_routing(topk_ids: torch.Tensor, experts: int, block_m: int):
    """(sorted_ids, expert_ids, num_tokens_padded) for humming's INDEXED MoE GEMM (moe_align_block_size
    format): per expert, its flat (token, slot) ids padded with T*k to a multiple of ``block_m``. Built once,
    on the host side (humming's own testing helper), outside the timed call."""
    from humming.config import GemmType
    from humming.testing.data import generate_moe_tensors

    _, _, sorted_ids, expert_ids, padded = generate_moe_tensors(topk_ids, experts, GemmType.INDEXED,
                                                                block_size_config=block_m)
    return sorted_ids, expert_ids, padded


def prepare_humming(x, topk_ids, topk_weights, w1, w3, w2, s1, s3, s2, limit) -> Runner | str:
    """humming peer: INDEXED W4A16 GEMM for w1|w3 (top_k rows per token), our SwiGLU in torch (fp32; humming's
    fused activations are the gpt-oss / plain-silu variants), INDEXED GEMM for w2, top-k weighted sum in torch.
    The routing tables are built before timing (unlike ours, whose call includes them). CUDA-graph capture:
    vLLM captures these launches, so it should work; the first call JIT-compiles with NVRTC (seconds to
    minutes per tile config), which ``_time`` does outside the capture."""
    try:
        import humming  # noqa: F401
        from humming.config import GemmType
        from humming.tune import get_heuristics_config
    except Exception as exc:  # noqa: BLE001
        return f"humming-kernels unavailable: {_reason(exc)}"
    try:
        experts, inter = w1.shape[0], w1.shape[1]
        tokens, k = topk_ids.shape
        hidden = x.shape[1]
        l13 = humming_layer(torch.cat((w1, w3), 1), torch.cat((_u8(s1), _u8(s3)), 1))
        l2 = humming_layer(w2, s2)
        compute = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                              "gemm_type": GemmType.INDEXED.value})
        t13 = get_heuristics_config(layer_config=l13.humming_config, gemm_type=GemmType.INDEXED)
        t2 = get_heuristics_config(layer_config=l2.humming_config, gemm_type=GemmType.INDEXED)
        block_m = _humming_block_m(t13, tokens * k)
        # contiguous: a [T, k] slice of a wider argsort (the benchmark's routing) fails humming's flattening view
        sorted_ids, expert_ids, padded = humming_routing(topk_ids.contiguous(), experts, block_m)
        t13s, t2s = json.dumps(t13), json.dumps(t2)
        gate_up = torch.empty(tokens * k, 2 * inter, dtype=torch.bfloat16, device=x.device)
        down = torch.empty(tokens * k, hidden, dtype=torch.bfloat16, device=x.device)
        weights = topk_weights.float().unsqueeze(-1)
        moe = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                   compute_config=compute)

        def run() -> torch.Tensor:
            l13(x, outputs=gate_up, top_k=k, tuning_config=t13s, **moe)
            h = swiglu_fp32(gate_up[:, :inter], gate_up[:, inter:], limit).to(torch.bfloat16)
            l2(h, outputs=down, top_k=1, tuning_config=t2s, **moe)
            return (down.view(tokens, k, hidden).float() * weights).sum(1).to(torch.bfloat16)

        return run
    except Exception as exc:  # noqa: BLE001
        return f"humming conversion failed: {_reason(exc)}"


PEERS = {HUMMING_NAME: prepare_humming, TRITON_KERNELS_NAME: prepare_triton_kernels}


class PeerBackend:
    """Adapts a prepared ``run()`` to ``gpu_mxfp4._time``'s ``backend.routed_experts(...)`` call (the arguments
    are the ones the peer was prepared with, so they are ignored)."""

    def __init__(self, run: Runner):
        self.run = run

    def routed_experts(self, *_args):
        return self.run()


def prepare_all(x, topk_ids, topk_weights, weights) -> dict[str, Runner | str]:
    """Every peer for one problem, from our ``ExpertWeights`` (packed MXFP4 + e8m0 scales)."""
    args = (x, topk_ids, topk_weights, weights.w1, weights.w3, weights.w2,
            weights.w1_scale, weights.w3_scale, weights.w2_scale, weights.swiglu_limit)
    return {name: prepare(*args) for name, prepare in PEERS.items()}


def check(tokens: int = 4, experts: int = 384, hidden: int = 5120, inter: int = 2304, top_k: int = 6) -> list:
    """One small problem through each peer vs our torch reference (FP8 activations) and the W4A16 one."""
    from deepinfer.runtime.quantization import quantize_fp4
    from deepinfer.plugins.builtin.torch_moe import TorchMoE
    from deepinfer.plugins.interfaces import ExpertWeights

    device = torch.device("cuda")
    torch.manual_seed(0)

    def stack(rows, cols):
        packed, scales = zip(*(quantize_fp4(torch.randn(rows, cols, device=device) * cols**-0.5)
                               for _ in range(experts)))
        return torch.stack(packed), torch.stack(scales)

    (w1, s1), (w3, s3), (w2, s2) = stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)
    weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, 32)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.rand(tokens, experts, device=device).argsort(1)[:, :top_k]
    topk_weights = torch.rand(tokens, top_k, device=device)
    expected = TorchMoE().routed_experts(x, ids, topk_weights, weights).float()
    w4a16 = reference_w4a16(x, ids, topk_weights, w1, w3, w2, s1, s3, s2, 10.0).float()
    rows = [{"kernel": "torch W4A16 reference vs FP8-activation reference",
             "err_rel": round(float((w4a16 - expected).norm() / expected.norm()), 6)}]
    print(json.dumps(rows[0]), flush=True)
    for name, prepare in PEERS.items():
        row = {"kernel": name, "tokens": tokens}
        start = time.perf_counter()
        run = prepare(x, ids, topk_weights, w1, w3, w2, s1, s3, s2, 10.0)
        row["prepare_s"] = round(time.perf_counter() - start, 2)
        if isinstance(run, str):
            row["reason"] = run
        else:
            try:
                start = time.perf_counter()
                got = run().float()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - start, 2)
                row["err_rel"] = round(float((got - expected).norm() / expected.norm()), 6)
                row["err_rel_w4a16"] = round(float((got - w4a16).norm() / w4a16.norm()), 6)
                row["bit_repeatable"] = bool(torch.equal(run(), run()))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                graph.replay()
                torch.cuda.synchronize()
                row["graph_capture"] = True
            except Exception as exc:  # noqa: BLE001
                row["error"] = _reason(exc)
                row["traceback_tail"] = traceback.format_exc()[-600:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="run one small problem (T=4) through each peer")
    parser.add_argument("--tokens", type=int, default=4)
    arguments = parser.parse_args()
    if arguments.check:
        check(arguments.tokens)
    else:
        parser.print_help()
