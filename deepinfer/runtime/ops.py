"""Plain-torch math shared by the model and the reference plugins."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.runtime.quantization import blockwise_linear, dequantize
from deepinfer.plugins.interfaces import RouterWeights


def project(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, activation_block: int) -> torch.Tensor:
    """``x W^T`` in fp32 for a float weight (upcast) or a quantized one (``blockwise_linear``)."""
    if scale is None:
        return x.float() @ weight.float().T
    return blockwise_linear(x.float(), weight, scale, activation_block)


def grouped_product(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Each group's slice of ``x`` [T, G, C] times its rows of a float ``dense`` [G R, C]: [T, G, R] (one einsum,
    which batch-invariant mode tiles by rows)."""
    return torch.einsum("tgc,grc->tgr", x, dense.view(x.shape[1], -1, dense.shape[-1]))


def grouped_dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``LinearBackend.grouped_linear`` in torch: the weight dequantized to ``x``'s dtype, then each group's product
    (as the release computes ``wo_a`` from the copy it dequantizes when it loads)."""
    return grouped_product(x, dequantize(weight, scale, x.dtype))


_UPCAST_ROWS = 1 << 13  # weight rows upcast at a time: an fp32 slab, never a whole head's fp32 copy


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden W^T`` in fp32 with ``weight`` upcast a slab of rows at a time (``LinearBackend.logits``)."""
    if weight.dtype == torch.float32:
        return hidden.float() @ weight.T
    hidden = hidden.float()
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, weight.shape[0], _UPCAST_ROWS):
        out[:, start:start + _UPCAST_ROWS] = hidden @ weight[start:start + _UPCAST_ROWS].float().T
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU in fp32: ``silu(min(gate, L)) * clamp(up, -L, L)``."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(min=-limit, max=limit)


SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


def route_tokens(x: torch.Tensor, token_ids: torch.Tensor, router: RouterWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoEBackend.route`` in torch (every backend's reference): each token's expert ids and weights."""
    if router.scoring_func not in SCORE_FUNCTIONS:
        raise ValueError(f"unknown router scoring_func {router.scoring_func!r}; expected {list(SCORE_FUNCTIONS)}")
    scores = SCORE_FUNCTIONS[router.scoring_func](x.float() @ router.weight.float().T)
    if router.tid2eid is not None:
        ids = router.tid2eid[token_ids].long()
    else:
        # sorted: the slots' order sets the order their outputs are summed in, and an unsorted top-k's order is
        # whatever its algorithm, chosen by the tensor's size, leaves
        ids = torch.topk(scores + router.bias, router.top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * router.route_scale


def descending_order(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores`` sorted along the last dim, best first, and their order, with the indexer's tie rule: equal scores
    keep their order (the earlier column wins). -0.0 becomes +0.0 first: a weighted sum of ReLUs is exactly zero
    wherever every head's ReLU is, signed by its weights, and a GPU radix sort would rank -0.0 below +0.0."""
    return (scores + 0.0).sort(dim=-1, descending=True, stable=True)


def select_topk(scores: torch.Tensor, candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """Row indices of the ``min(topk, C)`` best-scoring candidates, -1 where fewer are visible.

    ``scores`` [T, C] fp32, -inf where not visible. Ties go to the earlier candidate (``descending_order``);
    candidate lists hold entries oldest first, so among equal scores the lowest entry index wins, whatever the
    batch padded the list to. Every backend's ``indexer_topk`` selects with this function, so they all agree.
    """
    k = min(topk, candidates.shape[1])
    if k == 0:
        return torch.full((candidates.shape[0], 0), -1, dtype=torch.int64, device=candidates.device)
    values, order = descending_order(scores)
    picked = candidates.gather(1, order[:, :k])
    return torch.where(values[:, :k] == float("-inf"), -1, picked)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Projects ``[..., n, n]`` logits towards a doubly-stochastic matrix (row softmax, then alternating sums)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_logits(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               norm_eps: float) -> torch.Tensor:
    """One sublayer's hyper-connection logits [T, (2 + n) n] fp32 from its streams [T, n, D] (see
    ``MHCBackend.weights``): projected first, then scaled by the RMS, as the released kernel does."""
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    mixes = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    scales = torch.cat((scale[0].expand(n), scale[1].expand(n), scale[2].expand(n * n)))
    return torch.addcmul(base, mixes, scales)


def mhc_coefficients(logits: torch.Tensor, hc_mult: int, sinkhorn_iters: int, eps: float):
    """``pre``, ``post`` and ``comb`` of one sublayer's hyper-connection (see ``MHCBackend.coefficients``)."""
    n = hc_mult
    pre = torch.sigmoid(logits[:, :n]) + eps
    post = 2 * torch.sigmoid(logits[:, n : 2 * n])
    comb = sinkhorn(logits[:, 2 * n :].unflatten(-1, (n, n)), sinkhorn_iters, eps)
    return pre, post, comb


def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """``MHCBackend.collapse`` in torch: ``sum_i pre[:, i] * streams[:, i]`` in fp32, in the streams' dtype; then,
    with ``norm_weight``, the sublayer's input RMSNorm as the models' ``RMSNorm`` computes it."""
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(1).to(streams.dtype)
    if norm_weight is None:
        return collapsed
    return F.rms_norm(collapsed.float(), norm_weight.shape, norm_weight, eps).to(streams.dtype)


def mhc_expand(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``MHCBackend.expand`` in torch: ``post ⊗ output + combᵀ · streams`` in fp32, rounded once."""
    update = post.unsqueeze(-1) * output.float().unsqueeze(-2)
    # element-wise, not a batched matmul: its summation order would vary with the batch size (padded decode steps
    # must give what unpadded ones give), and V4.1's goldens were computed in this order
    mixed = (comb.unsqueeze(-1) * streams.float().unsqueeze(-2)).sum(1)
    return (update + mixed).to(output.dtype)


def engram_gate(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``MHCBackend.engram_gate`` in torch: each stream plus the memory's value, gated by how much the stream's
    RMS-normalized state agrees with the memory's key for it (DeepSeek-V4.1's Engram)."""
    hidden, key = streams.float(), key.float()
    rstd = torch.rsqrt(hidden.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (hidden * (q_weight.float() * k_weight.float()) * key).sum(-1) * rstd * hidden.shape[-1] ** -0.5
    # a sigmoid of the signed square root keeps the gate responsive for small and large similarities alike
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (hidden + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


def compress_pool(state: torch.Tensor, rows: torch.Tensor, ratio: int, overlap: int, norm_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """``AttentionBackend.compress_pool`` in torch (every backend's reference)."""
    gathered = state[rows.clamp(min=0)]  # [n, overlap*ratio, 2*overlap*dim]
    dim = norm_weight.shape[0]
    width = overlap * dim
    kv, score = gathered[..., :width], gathered[..., width:]
    if overlap == 2:
        kv = torch.cat([kv[:, :ratio, :dim], kv[:, ratio:, dim:]], dim=1)
        score = torch.cat([score[:, :ratio, :dim], score[:, ratio:, dim:]], dim=1)
    missing = (rows < 0).unsqueeze(-1)
    kv = kv.masked_fill(missing, 0.0)
    score = score.masked_fill(missing, float("-inf"))
    pooled = (kv * score.softmax(dim=1)).sum(dim=1)
    return F.rms_norm(pooled.float(), (dim,), norm_weight, eps)


def rotate_pairs(x: torch.Tensor, phases: torch.Tensor, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """Rotates the trailing ``rope_dim`` channels of ``x`` [T, D] or [T, heads, D], read as interleaved complex pairs
    (x[2i], x[2i+1]), by ``phases`` [T, rope_dim/2] (unit complex numbers); the leading channels are left alone.

    In real arithmetic, in fp32: torch's vectorized complex product rounds differently (fused multiply-adds) from
    the scalar loop that finishes a tensor whose size is not a multiple of the vector width, so a row's rotation
    would depend on how many rows share the tensor."""
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    if x.dim() == 3:
        phases = phases.unsqueeze(1)
    cos, sin = phases.real, phases.imag
    if inverse:
        sin = -sin
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rotated), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalised ``x`` over its last dim in fp32, times ``weight`` (fp32) when given, in ``x``'s dtype (one
    fused kernel on CUDA plus the two casts)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def compressor_rows(kv: torch.Tensor, score: torch.Tensor, position_bias: torch.Tensor, positions: torch.Tensor
                    ) -> torch.Tensor:
    """V4 compressor-state rows ``[kv | score + position_bias[position % R]]`` in fp32 (R = position_bias rows)."""
    return torch.cat([kv.float(), score.float() + position_bias[positions % position_bias.shape[0]]], dim=-1)
