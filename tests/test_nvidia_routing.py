"""The NVIDIA backend's MoE routing (two Triton launches) against the torch reference, and the reference against the
formula the model used inline before routing became a backend call.

Natively on a GPU, in Triton's interpreter elsewhere (conftest turns it on); skipped without triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.ops import route_tokens  # noqa: E402
from deepinfer.plugins.interfaces import RouterWeights  # noqa: E402
from deepinfer_nvidia import routing  # noqa: E402
from deepinfer_nvidia.moe import TritonMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SCORING = ["sqrtsoftplus", "softmax", "sigmoid"]
VOCAB = 50
# (tokens, experts, top-k, hidden, x dtype), 19 tokens: more than a logits program takes (8)
SHAPES = [(0, 64, 6, 64, torch.bfloat16), (1, 256, 6, 128, torch.bfloat16), (5, 72, 2, 96, torch.float32),
          (19, 64, 2, 256, torch.bfloat16), (19, 256, 6, 64, torch.float32)]


def _router(experts, top_k, hidden, scoring, hashed, normalize, seed=0) -> RouterWeights:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, hidden, generator=g) / hidden**0.5
    tid2eid = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(VOCAB)]) if hashed else None
    bias = None if hashed else torch.randn(experts, generator=g) / 10
    return RouterWeights(weight.to(DEVICE), None if bias is None else bias.to(DEVICE),
                         None if tid2eid is None else tid2eid.to(DEVICE), top_k, scoring, normalize, 2.5)


def _inputs(tokens, hidden, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype).to(DEVICE)
    return x, torch.randint(0, VOCAB, (tokens,), generator=g).to(DEVICE)


@pytest.mark.parametrize("tokens, experts, top_k, hidden, dtype", SHAPES)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", SCORING)
def test_route_matches_the_reference(scoring, hashed, normalize, tokens, experts, top_k, hidden, dtype):
    router = _router(experts, top_k, hidden, scoring, hashed, normalize)
    x, token_ids = _inputs(tokens, hidden, dtype)
    ids, weights = TritonMoE(reference=None).route(x, token_ids, router)
    ref_ids, ref_weights = route_tokens(x, token_ids, router)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    assert torch.equal(ids, ref_ids)  # random logits: no ties, so no rounding can reorder them
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pinned", [False, True])
def test_past_cublas_tokens_the_logits_come_from_cublas_unless_pinned(pinned):
    router = _router(72, 6, 64, "sqrtsoftplus", False, True)
    x, token_ids = _inputs(routing.CUBLAS_TOKENS + 1, 64, torch.bfloat16)
    ids, weights = TritonMoE(reference=None, pinned=pinned).route(x, token_ids, router)
    ref_ids, ref_weights = route_tokens(x, token_ids, router)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pinned", [False, True])
def test_ties_go_to_the_lowest_expert_first(pinned):
    experts, top_k = 72, 6
    bias = torch.zeros(experts, device=DEVICE)
    bias[[9, 5, 40]] = torch.tensor([1.0, 1.0, 0.5], device=DEVICE)
    router = RouterWeights(torch.zeros(experts, 64, device=DEVICE), bias, None, top_k, "sqrtsoftplus", True, 1.0)
    x, token_ids = _inputs(3, 64, torch.bfloat16)
    ids, weights = TritonMoE(reference=None, pinned=pinned).route(x, token_ids, router)
    assert ids.tolist() == [[5, 9, 40, 0, 1, 2]] * 3  # every logit is 0: the bias alone orders them
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / top_k))


def test_a_pinned_tokens_routing_ignores_the_batch():
    """Pinned: a token's routing is bitwise the same alone and among others, past CUBLAS_TOKENS too."""
    router = _router(72, 6, 256, "sqrtsoftplus", False, True)
    x, token_ids = _inputs(routing.CUBLAS_TOKENS + 9, 256, torch.bfloat16)
    moe = TritonMoE(reference=None, pinned=True)
    first_ids, first_weights = moe.route(x[:1], token_ids[:1], router)
    for count in (3, 8, 9, routing.CUBLAS_TOKENS + 9):
        ids, weights = moe.route(x[:count], token_ids[:count], router)
        assert torch.equal(ids[:1], first_ids) and torch.equal(weights[:1], first_weights), count


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_routing_replays_in_a_cuda_graph():
    router = _router(256, 6, 4096, "sqrtsoftplus", False, True)
    x, token_ids = _inputs(4, 4096, torch.bfloat16)
    moe = TritonMoE(reference=None)
    moe.route(x, token_ids, router)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = moe.route(x, token_ids, router)
    x.copy_(_inputs(4, 4096, torch.bfloat16, seed=7)[0])
    graph.replay()
    ref_ids, ref_weights = route_tokens(x, token_ids, router)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_unsupported_routers_are_refused():
    moe = TritonMoE(reference=None)
    x, token_ids = _inputs(2, 64, torch.float32)
    router = _router(64, 6, 64, "sqrtsoftplus", False, True)
    for change, message in [({"scoring_func": "relu"}, "unknown router scoring_func"),
                            ({"top_k": 65}, "top_k 65 must be in 1..64"),
                            ({"bias": None}, "needs a bias"),
                            ({"weight": router.weight[:, :32]}, r"x \[T, hidden\] and a gate weight"),
                            ({"tid2eid": torch.zeros(VOCAB, 2, dtype=torch.int64, device=DEVICE)}, "tid2eid"),
                            ({"weight": torch.zeros(4097, 64, device=DEVICE), "bias": torch.zeros(4097,
                                                                                               device=DEVICE)},
                             "at most 4096 experts")]:
        fields = {name: getattr(router, name) for name in RouterWeights.__slots__} | change
        with pytest.raises(ValueError, match=message):
            moe.route(x, token_ids, RouterWeights(**fields))


# What ``MoE.route`` computed before routing moved behind ``MoEBackend.route``.
_OLD_SCORE_FUNCTIONS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


def _old_route(x, token_ids, gate_weight, bias, tid2eid, top_k, scoring, norm_topk_prob, route_scale):
    scores = _OLD_SCORE_FUNCTIONS[scoring](x.float() @ gate_weight.float().T)
    if tid2eid is not None:
        ids = tid2eid[token_ids].long()
    else:
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * route_scale


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", SCORING)
def test_the_reference_is_the_old_inline_formula(scoring, hashed, normalize):
    router = _router(72, 6, 96, scoring, hashed, normalize)
    x, token_ids = _inputs(7, 96, torch.bfloat16)
    ids, weights = route_tokens(x, token_ids, router)
    old_ids, old_weights = _old_route(x, token_ids, router.weight, router.bias, router.tid2eid, router.top_k,
                                      scoring, normalize, router.route_scale)
    assert torch.equal(ids, old_ids) and torch.equal(weights, old_weights)
