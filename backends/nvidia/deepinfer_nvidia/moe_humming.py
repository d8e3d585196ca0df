"""MXFP4 routed experts through humming-kernels (vLLM's SM90 choice for DeepSeek-V4's experts): an optional route,
``pip install -e 'backends/nvidia[humming]'``, which ``moe.TritonMoE`` takes for the layers ``serves`` accepts.

Numerics. Humming's W4A16 GEMM expands MXFP4 weights to bf16 and multiplies bf16 activations with fp32 sums. The
activations it gets are already rounded to FP8 in 1 x 32 blocks (``fp8_rounded``: an e4m3 value times a power of
two, exact in bf16), and an e2m1 code times its e8m0 scale is exact in bf16 too, so every product is the
reference's. What differs is that the GEMMs write bf16: gate and up are rounded before SwiGLU (as in DeepSeek's own
inference code, and DeepGEMM's grouped route, ``moe_grouped``), each slot's down projection before the top-k sum.

Layout. Humming reads its own swizzle of the same bytes. Each layer is converted once, ``CONVERT_EXPERTS`` experts
at a time, back into the tensors' own storage, so no second copy of the experts is ever held; the tensors are then
marked (``moe_mxfp4_layout.LAYOUT_ATTRIBUTE``) and only this route reads them, prefills included. w1 and w3 stay two
GEMMs because they are two tensors.

Routing. Humming's indexed GEMM takes vLLM's ``moe_align_block_size`` tables: the flat (token, slot) ids sorted by
expert, each expert's run padded to the block size with the sentinel ``tokens x top_k``, each block's expert, and
the padded total. They come from ``moe_blocks``' block table and one more launch (nothing synchronises with the
host: a CUDA graph can hold them). The tile configuration is humming's heuristic for the call's rows, fixed on the
host from shapes alone, so that the table's block size is the one the kernel runs with. At some row counts that
heuristic splits K across programs (stream-K), whose partial sums then land in a varying order: outputs there are
not bit-repeatable (``DEEPINFER_BATCH_INVARIANT=1`` keeps the Triton kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.logger import init_logger
from deepinfer_nvidia import moe_blocks
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs
from deepinfer_nvidia.fp8_rounding import fp8_rounded, swiglu_fp8_rounded
from deepinfer_nvidia.moe_mxfp4_layout import LAYOUT_ATTRIBUTE

logger = init_logger(__name__)

VERSION = "0.1.19"  # the release whose layout conversion and GEMM arguments this module was written against
HUMMING_LAYOUT = "humming"  # the tensors' mark once converted
CONVERT_EXPERTS = 16  # experts converted at a time: the conversion's scratch (about 150 MB at V4.1-Flash's widths)
# Widths humming takes without padding (vLLM pads N to 256 and K to 128); every V4 and V4.1 expert width is one.
N_MULTIPLE, K_MULTIPLE = 256, 128


@functools.cache
def load():
    """``(humming module, route)`` or ``(None, why not)``; ``DEEPINFER_KERNELS=triton`` leaves it unused."""
    if envs.get().DEEPINFER_KERNELS == "triton":
        return None, "DEEPINFER_KERNELS=triton: Triton only"
    try:
        import humming
        from humming.forward import humming_forward  # noqa: F401 (the entry point used below)
    except Exception as exc:  # noqa: BLE001 (reported in the engine log)
        return None, f"humming: {exc}"
    version = getattr(humming, "__version__", "?")
    if version != VERSION:
        return None, f"humming-kernels {version} installed, this route is written for {VERSION}"
    return humming, f"humming-kernels {version}"


def serves(weights) -> str | None:
    """Why this layer's experts cannot take the route, or None: packed MXFP4 with 1 x 32 scales, widths humming
    takes unpadded, on SM90 (where it was measured against the Triton kernels)."""
    w1, w2 = weights.w1, weights.w2
    if w1.dtype != torch.int8 or weights.w1_scale is None or not w1.is_cuda:
        return "not packed MXFP4 on a GPU"
    if torch.cuda.get_device_capability(w1.device)[0] != 9:
        return "measured on SM90 only"
    inter, hidden = w1.shape[1], w2.shape[1]
    if inter % N_MULTIPLE or hidden % N_MULTIPLE or hidden % K_MULTIPLE or inter % K_MULTIPLE:
        return f"widths {hidden} and {inter} are not multiples of {N_MULTIPLE} (N) and {K_MULTIPLE} (K)"
    if any(t.shape[-1] * 2 != 32 * s.shape[-1] for t, s in ((w1, weights.w1_scale), (w2, weights.w2_scale))):
        return "scales are not one per 32 values"
    stacks = (w1, weights.w3, w2, weights.w1_scale, weights.w3_scale, weights.w2_scale)
    if not all(t.is_contiguous() for t in stacks):  # converted in place, as flat bytes
        return "not contiguous"
    return None


@dataclasses.dataclass(slots=True)
class Projection:
    """One stacked projection in humming's layout: its layer configuration and the weight and scale views of the
    converted storage."""

    config: object  # humming.config.LayerConfig
    weight: torch.Tensor
    scale: torch.Tensor
    locks: torch.Tensor  # humming's stream-K counters, one set per projection

    def tuning(self, rows: int) -> tuple[str, int]:
        """Humming's heuristic tile configuration for ``rows`` GEMM rows, as JSON, and its block size."""
        return _tuning(self.config, rows, STREAM_K)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, tables, tuning: str, top_k: int) -> torch.Tensor:
        from humming.forward import humming_forward

        sorted_ids, expert_ids, padded = tables
        return humming_forward(self.config, inputs=x, weight=self.weight, weight_scale=self.scale, outputs=out,
                               sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded,
                               locks=self.locks, top_k=top_k, compute_config=_COMPUTE, tuning_config=tuning)


STREAM_K = True  # humming's heuristics as they are (False: no stream-K split; timed by tools/gpu/gpu_mxfp4.py)
_COMPUTE = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"})


@functools.lru_cache(maxsize=256)
def _tuning(config, rows: int, stream_k: bool) -> tuple[str, int]:
    from humming.config import GemmType
    from humming.tune import get_heuristics_config

    chosen = get_heuristics_config(layer_config=config, shape_m=rows, gemm_type=GemmType.INDEXED)
    if not stream_k:
        chosen = chosen | {"use_stream_k": False}
    return json.dumps(chosen), int(chosen["block_shape"][0])


def convert(codes: torch.Tensor, scales: torch.Tensor) -> Projection:
    """Converts one stacked projection (int8 [E, N, K/2] codes, e8m0 [E, N, K/32] scales) to humming's layout in
    place, ``CONVERT_EXPERTS`` experts at a time, and returns its views."""
    from humming.layer import HummingLayer
    from humming.schema import Mxfp4WeightSchema

    experts, n, half_k = codes.shape
    config = weight = scale = None
    for first in range(0, experts, CONVERT_EXPERTS):
        part = slice(first, min(first + CONVERT_EXPERTS, experts))
        layer = HummingLayer(shape_n=n, shape_k=2 * half_k, weight_config=Mxfp4WeightSchema(),
                             num_experts=part.stop - part.start, torch_dtype=torch.bfloat16).to(codes.device)
        layer.load_from_tensors({"weight": codes[part].view(torch.uint8),
                                 "weight_scale": scales[part].view(torch.uint8)})
        layer.transform()
        for ours, theirs in ((codes[part], layer.weight), (scales[part], layer.weight_scale)):
            if ours.nbytes != theirs.nbytes:  # a padded or widened layout: converting in place cannot hold it
                raise ValueError(f"humming's layout of {tuple(ours.shape)} is {theirs.nbytes} bytes, not {ours.nbytes}")
            ours.view(torch.uint8).view(-1).copy_(theirs.detach().contiguous().view(torch.uint8).view(-1))
        config, weight, scale = layer.humming_config, layer.weight, layer.weight_scale
    full_config = dataclasses.replace(config, num_experts=experts)
    return Projection(full_config, _view_as(codes, weight, experts), _view_as(scales, scale, experts),
                      torch.zeros(2048, dtype=torch.int32, device=codes.device))


def _view_as(storage: torch.Tensor, like: torch.Tensor, experts: int) -> torch.Tensor:
    """``storage`` (contiguous) seen with ``like``'s dtype and per-expert shape for all ``experts``."""
    return storage.view(torch.uint8).view(-1).view(like.dtype).view(experts, *like.shape[1:])


@dataclasses.dataclass(slots=True)
class Layer:
    gate: Projection
    up: Projection
    down: Projection


def prepare(weights) -> Layer:
    """The layer's projections in humming's layout, converted on first sight and kept on the w1 tensor."""
    layer = getattr(weights.w1, "_humming_layer", None)
    if layer is not None:
        return layer
    stacks = ((weights.w1, weights.w1_scale), (weights.w3, weights.w3_scale), (weights.w2, weights.w2_scale))
    marks = {getattr(codes, LAYOUT_ATTRIBUTE, None) for codes, _ in stacks}
    if marks != {None}:
        raise ValueError(f"MXFP4 experts already in another layout ({marks}): humming cannot convert them")
    layer = Layer(*(convert(codes, scales) for codes, scales in stacks))
    for codes, _ in stacks:
        setattr(codes, LAYOUT_ATTRIBUTE, HUMMING_LAYOUT)
    weights.w1._humming_layer = layer
    logger.info(f"MXFP4 experts {tuple(weights.w1.shape[1:])}, {tuple(weights.w2.shape[1:])}: converted to "
                f"humming's layout (humming-kernels serves them)")
    return layer


@triton.jit
def _indexed_kernel(order_ptr, rows_ptr, start_ptr, sorted_ptr, padded_ptr, num_blocks, sentinel,
                    BLOCK: tl.constexpr, SLOTS: tl.constexpr, COUNT_CHUNK: tl.constexpr):
    """Program b writes block b's ids (BLOCK of them, SLOTS its power of two); program 0 also counts the blocks with
    rows (they come first)."""
    wait_for_inputs()
    b = tl.program_id(0)
    rows = tl.load(rows_ptr + b)
    start = tl.load(start_ptr + b)
    slot = tl.arange(0, SLOTS)
    ids = tl.load(order_ptr + start + slot, mask=slot < rows, other=sentinel)
    tl.store(sorted_ptr + b * BLOCK + slot, ids, mask=slot < BLOCK)
    if b == 0:
        used = 0
        for first in range(0, num_blocks, COUNT_CHUNK):
            offs = first + tl.arange(0, COUNT_CHUNK)
            used += tl.sum((tl.load(rows_ptr + offs, mask=offs < num_blocks, other=0) > 0).to(tl.int32))
        tl.store(padded_ptr, used * BLOCK)


def indexed_tables(topk_ids: torch.Tensor, experts: int, block: int):
    """``(sorted_ids, expert_ids, num_tokens_padded)`` in ``moe_align_block_size``'s format for ``block``-row blocks:
    the grid-sized block table (``moe_blocks``), then one launch; the surplus blocks lie past the padded total."""
    order, _, _, (expert, start, rows) = moe_blocks.assignment_blocks(topk_ids, experts, block)
    num_blocks = expert.numel()
    sorted_ids = torch.empty(num_blocks * block, dtype=torch.int32, device=topk_ids.device)
    padded = torch.empty((), dtype=torch.int32, device=topk_ids.device)
    _indexed_kernel[(num_blocks,)](order, rows, start, sorted_ids, padded, num_blocks, topk_ids.numel(), BLOCK=block,
                                   SLOTS=triton.next_power_of_2(block),
                                   COUNT_CHUNK=min(1024, triton.next_power_of_2(num_blocks)), **LAUNCH)
    return sorted_ids, expert, padded


def routed_experts(weights, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    layer = prepare(weights)
    top_k = topk_ids.shape[1]
    experts, assignments = weights.w1.shape[0], topk_ids.numel()
    block = weights.activation_block
    rows = fp8_rounded(x, block)
    tables = {}

    def project(projection, inputs, width, k):
        tuning, block_m = projection.tuning(assignments)
        if block_m not in tables:
            tables[block_m] = indexed_tables(topk_ids, experts, block_m)
        out = torch.empty(assignments, width, dtype=torch.bfloat16, device=x.device)
        return projection(inputs, out, tables[block_m], tuning, k)

    inter, hidden = weights.w1.shape[1], weights.w2.shape[1]
    gate = project(layer.gate, rows, inter, top_k)
    up = project(layer.up, rows, inter, top_k)
    h = swiglu_fp8_rounded(gate, up, weights.swiglu_limit, block)
    down = project(layer.down, h, hidden, 1)
    return moe_blocks.combine(down, topk_weights, x.dtype)
