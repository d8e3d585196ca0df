"""The indexer's tie rule: among equal scores the earlier candidate wins (candidate lists hold entries oldest first, so
the lowest entry index), -0.0 and +0.0 are equal, and every backend that selects top-k (the torch reference,
batch-invariant mode's blocked reference, the NVIDIA plugin's Triton indexer) picks the same entries on exact ties.

Exact ties are common, not contrived: a score is ``sum_h w[h] relu(q[h] . k)``, exactly zero for every entry whose
dot products are all negative (and -0.0 wherever a kernel's sum starts from a negative weight's product).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deepinfer.runtime.ops import descending_order, select_topk
from deepinfer.plugins.builtin.torch_attention import TorchAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "features" / "batch_invariant"))
from deepinfer_batch_invariant.attention import BlockedTorchAttention  # noqa: E402

NEG_INF = float("-inf")


def test_equal_scores_go_to_the_earlier_candidate():
    scores = torch.tensor([[3.0, 0.0, -0.0, 0.0, 5.0, 0.0, NEG_INF]])
    candidates = torch.tensor([[10, 11, 12, 13, 14, 15, -1]])
    assert select_topk(scores, candidates, 4).tolist() == [[14, 10, 11, 12]]
    assert select_topk(scores, candidates, 7).tolist() == [[14, 10, 11, 12, 13, 15, -1]]


def test_negative_zero_ranks_as_zero():
    values, order = descending_order(torch.tensor([[-0.0, 0.0, -0.0, -1.0]]))
    assert order.tolist() == [[0, 1, 2, 3]]
    assert not torch.signbit(values[0, :3]).any()  # what a bitwise (radix) sort sees is +0.0 as well


def test_the_choice_does_not_depend_on_padding():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (4, 9), generator=g).float()  # many exact ties
    candidates = torch.arange(9).repeat(4, 1)
    padded_scores = torch.cat([scores, torch.full((4, 7), NEG_INF)], dim=1)
    padded_candidates = torch.cat([candidates, torch.full((4, 7), -1)], dim=1)
    assert torch.equal(select_topk(scores, candidates, 5), select_topk(padded_scores, padded_candidates, 5))


def _relu_ties(tokens: int = 6, heads: int = 4, dim: int = 16, rows: int = 48, width: int = 40, seed: int = 1):
    """Indexer inputs where most candidates score exactly zero: keys of one sign pattern against queries of the
    opposite one (every dot product negative, every ReLU 0), weights of both signs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(tokens, heads, dim, generator=g) + 0.1
    keys = torch.rand(rows, dim, generator=g) + 0.1
    keys[rows // 3:] *= -1  # two thirds of the rows: every head's ReLU is 0
    weights = torch.randn(tokens, heads, generator=g)
    candidates = torch.stack([torch.randperm(rows, generator=g)[:width].sort().values for _ in range(tokens)])
    candidates[tokens // 2, width // 2:] = -1
    return q, weights, keys, candidates


def _expected(scores: torch.Tensor, candidates: torch.Tensor, topk: int) -> list[list[int]]:
    """The rule written out: best score first, equal scores by ascending candidate position, hidden ones last."""
    out = []
    for row_scores, row in zip(scores.tolist(), candidates.tolist()):
        visible = [(-s, i, c) for i, (s, c) in enumerate(zip(row_scores, row)) if c >= 0]
        chosen = [c for _, _, c in sorted(visible)[:topk]]
        out.append(chosen + [-1] * (min(topk, len(row)) - len(chosen)))
    return out


def _backends():
    backends = [("torch reference", TorchAttention()), ("batch-invariant", BlockedTorchAttention())]
    try:
        import triton  # noqa: F401
    except ImportError:
        return backends
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))
    from deepinfer_nvidia.attention import TritonAttention

    return backends + [("nvidia triton", TritonAttention())]  # natively on a GPU, interpreted elsewhere


@pytest.mark.parametrize("topk", [3, 12, 40])
def test_every_backend_breaks_relu_ties_by_entry_order(topk):
    q, weights, keys, candidates = _relu_ties()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, weights, keys, candidates = (t.to(device) for t in (q, weights, keys, candidates))
    reference_scores = TorchAttention().indexer_scores(q, weights, keys, candidates)
    zeros = int((reference_scores == 0).sum())
    assert zeros > candidates.numel() // 2  # the ties this test is about
    expected = _expected(reference_scores.cpu(), candidates.cpu(), topk)
    for name, backend in _backends():
        picked = backend.indexer_topk(q, weights, keys, candidates, topk)
        assert picked.cpu().tolist() == expected, name


def test_ascend_selects_with_the_reference_rule():
    """The Ascend backend scores on the NPU but keeps the reference's selection (no NPU here to run it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "ascend"))
    from deepinfer_ascend.attention import AscendAttention

    assert AscendAttention.indexer_topk is TorchAttention.indexer_topk
