"""MoE routing in two Triton launches: the router's logits, then each token's scores, experts and weights.

The torch reference (``deepinfer.runtime.ops.route_tokens``) is 12 kernels per layer at decode on an H200: x's cast to
fp32, cuBLAS's GEMV, the score function's element-wise ops, a sort-based top-k, a gather and the normalisation;
25 us of device time at batch 1 inside a CUDA graph, against 6 us here (V4-Flash's router, E=256, H=4096).

* ``_logits_kernel`` writes the [T, E] fp32 logits, reading x in its own dtype and the weight in fp32, products
  summed in fp32 (no TF32). At decode the weight read (4 MB for V4-Flash) is the whole cost: each program loads
  whole weight rows of a few experts at once (all its bytes in flight), 128 programs at T=1, then multiplies each of
  its ``BLOCK_T`` tokens by them. A logit's summation order follows from the tile, which depends on the hidden size
  alone, so a token's logits do not depend on the step's other tokens (batch-invariant). From ``CUBLAS_TOKENS``
  tokens on, cuBLAS's GEMM is faster (it reuses what it loads; this kernel reads the weight again per token block),
  and computes the logits unless the backend is pinned to batch-invariant tiles.
* ``_select_kernel`` takes one token a program, its E scores in registers: the score function, the bias, top-k by
  repeated argmax (or the ``tid2eid`` row for hash layers), the chosen scores, normalised and scaled. Equal biased
  scores go to the lowest expert index first (``torch.topk`` leaves that order unspecified).

Nothing waits on the host: a decode step's routing can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.plugins.interfaces import RouterWeights
from deepinfer_nvidia.dependent_launch import LAUNCH, wait_for_inputs

SCORE_CODES = {"sqrtsoftplus": 0, "softmax": 1, "sigmoid": 2}
MAX_EXPERTS = 4096  # one token's scores in registers: E_PAD fp32 and a few like them per program
LOGIT_ELEMENTS = 8192  # BLOCK_E x H_PAD weights per program: 2 experts of V4-Flash (H=4096), 128 programs at T=1
BLOCK_T = 8  # tokens per logits program
LOGIT_WARPS = 4
CUBLAS_TOKENS = 64  # H200, V4-Flash's router: 20 us against 22 at 64 tokens, 29 against 37 at 128


@triton.jit(do_not_specialize=["T"])  # one binary for every T (Triton would compile T == 1 apart)
def _logits_kernel(x_ptr, w_ptr, logits_ptr, T, E, H, stride_x, stride_w, H_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """logits[t, e] = sum_k x[t, k] w[e, k] in fp32 for BLOCK_T tokens and BLOCK_E experts.

    The experts' whole rows are loaded at once (all of a program's weight bytes in flight: what decode waits on),
    before the previous kernel's output is awaited (``dependent_launch``: no kernel writes them), then each token's
    row is multiplied by them and summed over k in the same layout, so in the same order."""
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_ok = experts < E
    k = tl.arange(0, H_PAD)
    k_ok = k < H
    w = tl.load(w_ptr + experts.to(tl.int64)[:, None] * stride_w + k[None, :],
                mask=expert_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    wait_for_inputs()
    for t in tl.static_range(BLOCK_T):
        row = tl.program_id(0) * BLOCK_T + t
        if row < T:  # the last block's missing tokens cost nothing
            x = tl.load(x_ptr + row.to(tl.int64) * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            logits = tl.sum(x[None, :] * w, axis=1)
            tl.store(logits_ptr + row * E + experts, logits, mask=expert_ok)


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0, accurate where u is below 1's rounding step (which 1 + u would drop)."""
    w = 1.0 + u
    tiny = w == 1.0
    return tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))


@triton.jit
def _scores(logits, expert_ok, SCORE: tl.constexpr):
    """The score function of one token's logits [E_PAD] (the padding experts kept out of the softmax)."""
    if SCORE == 0:  # sqrt(softplus) as torch computes softplus: the logit itself above 20
        soft = tl.where(logits > 20.0, logits, _log1p(tl.exp(tl.minimum(logits, 20.0))))
        scores = tl.sqrt_rn(soft)
    elif SCORE == 1:
        logits = tl.where(expert_ok, logits, float("-inf"))
        e = tl.exp(logits - tl.max(logits, axis=0))
        scores = tl.div_rn(e, tl.sum(e, axis=0))
    else:
        scores = tl.sigmoid(logits)
    return scores


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, token_ids_ptr, tid2eid_ptr, stride_table, ids_ptr, weights_ptr, E,
                   route_scale, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SCORE: tl.constexpr,
                   HASH: tl.constexpr, NORMALIZE: tl.constexpr):
    """One token's experts and weights from its logits (one token a program: its reductions never wait on another
    token's, and their order cannot depend on how many tokens the step has)."""
    wait_for_inputs()
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    expert_ok = e < E
    scores = _scores(tl.load(logits_ptr + token * E + e, mask=expert_ok, other=0.0), expert_ok, SCORE)
    if HASH:
        table_row = tid2eid_ptr + tl.load(token_ids_ptr + token).to(tl.int64) * stride_table
    else:
        bias = tl.load(bias_ptr + e, mask=expert_ok, other=0.0).to(tl.float32)
        biased = tl.where(expert_ok, scores + bias, float("-inf"))
    lane = tl.arange(0, K_PAD)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        if HASH:
            chosen = tl.load(table_row + k).to(tl.int32)
        else:
            best = tl.max(biased, axis=0)
            chosen = tl.min(tl.where(biased == best, e, E_PAD), axis=0)
            chosen = tl.minimum(chosen, E - 1)  # a NaN row matches nothing: stay a valid expert index
            biased = tl.where(e == chosen, float("-inf"), biased)
        # registers cannot be indexed: a sum over the one-hot picks the chosen score (exactly)
        weight = tl.sum(tl.where(e == chosen, scores, 0.0), axis=0)
        ids = tl.where(lane == k, chosen, ids)
        weights = tl.where(lane == k, weight, weights)
    if NORMALIZE:  # the padding lanes hold 0
        weights = tl.div_rn(weights, tl.sum(weights, axis=0) + 1e-20)
    out_ok = lane < TOP_K
    tl.store(ids_ptr + token * TOP_K + lane, ids.to(tl.int64), mask=out_ok)
    tl.store(weights_ptr + token * TOP_K + lane, weights * route_scale, mask=out_ok)


def _checked(x: torch.Tensor, token_ids: torch.Tensor, router: RouterWeights) -> None:
    weight = router.weight
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"routing needs x [T, hidden] and a gate weight [E, hidden], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    experts = weight.shape[0]
    if router.scoring_func not in SCORE_CODES:
        raise ValueError(f"unknown router scoring_func {router.scoring_func!r}; expected {list(SCORE_CODES)}")
    if not 0 < router.top_k <= experts:
        raise ValueError(f"router top_k {router.top_k} must be in 1..{experts} (the expert count)")
    if experts > MAX_EXPERTS:
        raise ValueError(f"the Triton router keeps a token's scores in registers: at most {MAX_EXPERTS} experts, "
                         f"got {experts}")
    if router.tid2eid is not None:
        if router.tid2eid.dim() != 2 or router.tid2eid.shape[1] != router.top_k or token_ids.shape != x.shape[:1]:
            raise ValueError(f"a hash layer needs tid2eid [vocab, top_k={router.top_k}] and token_ids [T], got "
                             f"{list(router.tid2eid.shape)} and {list(token_ids.shape)}")
    elif router.bias is None or router.bias.shape != (experts,):
        raise ValueError(f"a score-routed layer needs a bias [E={experts}], got "
                         f"{None if router.bias is None else list(router.bias.shape)}")


def route(x: torch.Tensor, token_ids: torch.Tensor, router: RouterWeights, pinned: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoEBackend.route``: ids [T, top_k] int64 and weights [T, top_k] fp32 in two launches."""
    _checked(x, token_ids, router)
    tokens, hidden = x.shape
    experts, top_k = router.weight.shape[0], router.top_k
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return ids, weights
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = router.weight.contiguous()
    if tokens >= CUBLAS_TOKENS and not pinned:
        logits = x.float() @ weight.float().T
    else:
        logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
        h_pad = triton.next_power_of_2(hidden)
        block_e = max(1, LOGIT_ELEMENTS // h_pad)
        grid = (triton.cdiv(tokens, BLOCK_T), triton.cdiv(experts, block_e))
        _logits_kernel[grid](x, weight, logits, tokens, experts, hidden, x.stride(0), weight.stride(0), H_PAD=h_pad,
                             BLOCK_T=BLOCK_T, BLOCK_E=block_e, num_warps=LOGIT_WARPS, **LAUNCH)
    hashed = router.tid2eid is not None
    # what the other kind of layer reads stands in for what this one does not
    table, token_ids = (router.tid2eid.contiguous(), token_ids.contiguous()) if hashed else (ids, ids)
    bias = logits if hashed else router.bias.contiguous()
    e_pad = triton.next_power_of_2(experts)
    _select_kernel[(tokens,)](logits, bias, token_ids, table, table.stride(0), ids, weights, experts,
                              float(router.route_scale), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                              E_PAD=e_pad, SCORE=SCORE_CODES[router.scoring_func], HASH=hashed,
                              NORMALIZE=bool(router.norm_topk_prob), num_warps=min(8, max(1, e_pad // 256)), **LAUNCH)
    return ids, weights
