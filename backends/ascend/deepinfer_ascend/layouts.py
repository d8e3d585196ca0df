"""Pure-torch conversions from DeepInfer's tensors to the arguments torch_npu's operators take, and back.

Nothing here imports torch_npu: these functions run on any device, so ``tests/test_ascend_backend.py`` feeds
their output to plain-torch renderings of each operator's documented semantics on a CPU and compares the result
with the reference backends'. Every ``*_arguments`` function returns ``(args, kwargs)`` for one operator call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from deepinfer.runtime.fp8_kv import WIDTH as FP8_WIDTH, FP8Rows
from deepinfer.runtime.quantization import dequantize, round_fp8

Pool = torch.Tensor | FP8Rows

# npu_sparse_flash_attention fixes query/key/value at 512 channels and query_rope/key_rope at 64; the 950 takes
# 1 to 128 query heads and KV_N 1; query, key and value in bf16 or fp16.
SFA_DIM, SFA_ROPE_DIM, SFA_MAX_HEADS = 512, 64, 128
SFA_DTYPES = (torch.bfloat16, torch.float16)
# Keys gathered per call are kept near this many elements (the reference attention's budget).
GATHER_BUDGET = 1 << 24
# npu_mhc_sinkhorn: n of 4, 6 or 8, 1 to 100 iterations; its doc gives [1, 512] rows "in inference".
SINKHORN_N, SINKHORN_MAX_ITERS, SINKHORN_ROWS = (4, 6, 8), 100, 512
# npu_mhc_post takes bf16/fp16 streams and layer outputs.
MHC_POST_DTYPES = (torch.bfloat16, torch.float16)


# --- sparse attention: npu_sparse_flash_attention ---------------------------------------------------------------

def pool_rows(pool: Pool) -> int:
    return pool.num_rows if isinstance(pool, FP8Rows) else pool.shape[0]


def pool_width(pool: Pool) -> int:
    return FP8_WIDTH if isinstance(pool, FP8Rows) else pool.shape[-1]


def sfa_unsupported(q: torch.Tensor, sources: Sequence[tuple[Pool, torch.Tensor]]) -> str | None:
    """Why npu_sparse_flash_attention cannot serve this call, or None when it can."""
    if q.dtype not in SFA_DTYPES:
        return f"queries in {q.dtype} (the operator takes bf16/fp16)"
    if q.shape[-1] != SFA_DIM or any(pool_width(pool) != SFA_DIM for pool, _ in sources):
        return f"{q.shape[-1]}-wide heads (the operator's D is fixed at {SFA_DIM})"
    if not 1 <= q.shape[1] <= SFA_MAX_HEADS:
        return f"{q.shape[1]} query heads (the 950 takes 1 to {SFA_MAX_HEADS})"
    if sum(indices.shape[1] for _, indices in sources) == 0:
        return "no key lists (the operator needs sparse_size > 0)"
    return None


def valid_first(indices: torch.Tensor) -> torch.Tensor:
    """Each row's valid ids (>= 0) first, in their order, then its -1s: the operator reads a row up to its first -1."""
    order = (indices < 0).to(torch.int32).argsort(dim=1, stable=True)
    return indices.gather(1, order)


def _rows(pool: Pool, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return pool[ids].to(dtype)  # FP8Rows dequantize when indexed


def concatenated_sources(sources: Sequence[tuple[Pool, torch.Tensor]], dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pool's rows stacked into one key tensor [M, D] and the indices [T, K] shifted into it."""
    keys, indices, offset = [], [], 0
    for pool, ids in sources:
        count = pool_rows(pool)
        keys.append(pool.to(dtype) if isinstance(pool, torch.Tensor) else
                    _rows(pool, torch.arange(count, device=ids.device), dtype))
        indices.append(torch.where(ids >= 0, ids + offset, -1))
        offset += count
    return torch.cat(keys), torch.cat(indices, dim=1)


def gathered_sources(sources: Sequence[tuple[Pool, torch.Tensor]], rows: slice, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys the queries ``rows`` name, gathered [t * K, D], and indices ``t * K + j`` into them (-1 kept)."""
    ids = torch.cat([indices[rows] for _, indices in sources], dim=1)
    keys = torch.cat([_rows(pool, indices[rows].clamp(min=0), dtype) for pool, indices in sources], dim=1)
    count, width = ids.shape
    positions = torch.arange(count * width, device=ids.device).view(count, width)
    return keys.flatten(0, 1), torch.where(ids >= 0, positions, -1)


def sfa_pieces(q: torch.Tensor, sources: Sequence[tuple[Pool, torch.Tensor]], budget: int = GATHER_BUDGET
               ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """``(query rows, keys [M, D], indices [t, K] into keys)`` per operator call, covering every query.

    The operator reads one key tensor, and a step's keys live in several pools (window rows, compressed entries).
    A single plain pool is passed as it is; otherwise whichever copies fewer rows: the pools stacked once, or each
    query's named keys gathered, in query chunks of about ``budget`` elements (decode steps name far fewer rows
    than the pools hold). The choice depends on shapes only.
    """
    tokens, width = q.shape[0], sum(indices.shape[1] for _, indices in sources)
    (pool, indices), *others = sources
    if not others and isinstance(pool, torch.Tensor):
        yield slice(0, tokens), pool.to(q.dtype), indices
        return
    if sum(pool_rows(pool) for pool, _ in sources) <= tokens * width:
        yield slice(0, tokens), *concatenated_sources(sources, q.dtype)
        return
    step = max(1, budget // (width * q.shape[-1]))
    for start in range(0, tokens, step):
        rows = slice(start, min(start + step, tokens))
        yield rows, *gathered_sources(sources, rows, q.dtype)


def sfa_arguments(q: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
                  ) -> tuple[tuple, dict]:
    """npu_sparse_flash_attention's arguments for queries [T, H, 512] over ``keys`` [M, 512] named by ``indices``.

    * MLA-absorb mode (``attention_mode=2``) is the only one the operator has: scores are
      ``[query | query_rope] . [key | key_rope]`` and the output is the softmax over ``value``. V4 keeps its RoPE
      channels inside the 512 (448 + 64) and uses the whole row as the value, so the row goes in as key and value
      and the rope inputs are zeros: they add nothing to any score.
    * One batch in TND layout (``actual_seq_lengths_*`` are cumulative: [T] and [M]), ``sparse_mode=0`` (no causal
      mask: the index lists already name only visible keys), ``sparse_block_size=1`` (token-wise ids, the only
      size the 950 takes), ids as int32 [T, 1, K] with the valid ones first.
    * ``sinks`` [H] fp32 enter the softmax denominator as ``exp(sink)`` (op-plugin's golden) as ours do; the
      argument selects aclnnSparseFlashAttentionV2, which the 950 has and A2/A3 do not.
    """
    tokens, heads, _ = q.shape
    count = keys.shape[0]
    key = keys.to(q.dtype).unsqueeze(1).contiguous()
    sparse = valid_first(indices).to(torch.int32).unsqueeze(1).contiguous()
    kwargs = dict(
        actual_seq_lengths_query=torch.tensor([tokens], dtype=torch.int32, device=q.device),
        actual_seq_lengths_kv=torch.tensor([count], dtype=torch.int32, device=q.device),
        query_rope=q.new_zeros(tokens, heads, SFA_ROPE_DIM), key_rope=key.new_zeros(count, 1, SFA_ROPE_DIM),
        sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=0, attention_mode=2,
        return_softmax_lse=False, sinks=sinks.float().contiguous())
    return (q.contiguous(), key, key, sparse, float(scale)), kwargs


# --- routed experts: npu_moe_init_routing_v2, npu_grouped_matmul, npu_clipped_swiglu ------------------------------

def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The grouped matmuls' dtype: bf16/fp16 activations stay so, anything else runs in fp32."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def activation(x: torch.Tensor, scale: torch.Tensor | None, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows entering a projection: for a quantized weight first rounded to FP8 per ``1 x block`` (``round_fp8``, in
    fp32), which bf16 holds exactly, so the cast to ``dtype`` changes nothing further."""
    return (x if scale is None else round_fp8(x.float(), block)).to(dtype)


def grouped_weight(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stacked experts [E, out, in] (float, FP8 or packed MXFP4) -> the operator's [E, in, out] in ``dtype``.

    Quantized experts are dequantized: e4m3 and e2m1 values times power-of-two scales are exact in bf16, so the
    products are the reference's; the documented grouped matmul has no FP8/MXFP4 weight path for the 950.
    """
    if scale is not None:
        weight = torch.stack([dequantize(w, s, dtype) for w, s in zip(weight, scale)])
    return weight.to(dtype).transpose(1, 2).contiguous()


def init_routing_arguments(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[tuple, dict]:
    """npu_moe_init_routing_v2 without dropping, padding or quantizing.

    Returns, per its doc: ``expanded_x`` [T*k, H] in expert order (a stable sort of the flat slots ``t*k + j`` by
    expert), ``expanded_row_idx`` [T*k] int32 with ``row_idx_type=0`` (gather: slot -> its row in ``expanded_x``),
    and the token count of each of the ``num_experts`` experts (``expert_tokens_num_type=1``), int64.
    """
    tokens, k = topk_ids.shape
    return (x.contiguous(), topk_ids.to(torch.int32).contiguous()), dict(
        active_num=tokens * k, expert_capacity=-1, expert_num=num_experts, drop_pad_mode=0,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1,
        active_expert_range=[0, num_experts], row_idx_type=0)


def grouped_matmul_arguments(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> tuple[tuple, dict]:
    """npu_grouped_matmul over expert-ordered rows: group i is the next ``counts[i]`` rows times ``weight[i]``
    [in, out] (m-axis grouping ``group_type=0``, sizes not cumsums ``group_list_type=1``, one output tensor)."""
    return ([x], [weight]), dict(group_list=counts.to(torch.int64), split_item=3, group_type=0, group_list_type=1)


def clipped_swiglu_arguments(gate_up: torch.Tensor, limit: float) -> tuple[tuple, dict]:
    """npu_clipped_swiglu computing ours, ``silu(min(gate, L)) * clamp(up, -L, L)`` in fp32.

    Its formula is ``A' * sigmoid(alpha * A') * (clamp(B, -L, L) + bias)`` with ``A' = min(A, L)``; ``alpha=1``
    and ``bias=0`` make it ours, and ``interleaved=False`` reads A (gate) and B (up) as the two halves, which is
    how the fused w1|w3 weight lays them out. An infinite limit (no clamp) becomes fp32's largest value.
    """
    finite = limit if abs(limit) != float("inf") else torch.finfo(torch.float32).max
    return (gate_up.float().contiguous(),), dict(dim=-1, alpha=1.0, limit=float(finite), bias=0.0, interleaved=False)


def combine(y: torch.Tensor, expanded_row_idx: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
            ) -> torch.Tensor:
    """Each token's weighted sum of its experts' rows [T, hidden] fp32, added one expert at a time in ascending expert
    order as the reference does (so the fp32 sums round alike)."""
    tokens, k = topk_ids.shape
    order = topk_ids.argsort(dim=1, stable=True)
    slots = torch.arange(tokens, device=y.device).unsqueeze(1) * k + order
    rows = y[expanded_row_idx.long()[slots]].float()  # [T, k, hidden]
    weights = topk_weights.float().gather(1, order)
    out = torch.zeros(tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    for j in range(k):
        out = out + rows[:, j] * weights[:, j:j + 1]
    return out


# --- hyper-connections: npu_mhc_sinkhorn, npu_mhc_post ------------------------------------------------------------

def sinkhorn_arguments(comb_logits: torch.Tensor, iters: int, eps: float) -> tuple[tuple, dict]:
    """npu_mhc_sinkhorn on [T, n, n] fp32 logits: a row softmax plus eps, a column normalisation, then ``iters - 1``
    row/column pairs, each sum plus eps: ``deepinfer.runtime.ops.sinkhorn`` step for step."""
    return (comb_logits.float().contiguous(),), dict(eps=float(eps), num_iters=int(iters), out_flag=0)


def mhc_post_arguments(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                       ) -> tuple[tuple, dict]:
    """npu_mhc_post(x, h_res, h_out, h_post) for ``post[:, o] * output + sum_i comb[:, i, o] * streams[:, i]``.

    ``comb`` goes in as it is: op-plugin's golden sums ``h_res[..., i, o] * x[..., i, :]`` over i, which is ours
    (its doc's "H_res x x_l" notation reads the other way; ``tools/validation/ascend_validate.py`` checks it on an NPU).
    """
    return (streams.contiguous(), comb.float().contiguous(), output.contiguous(), post.float().contiguous()), {}
