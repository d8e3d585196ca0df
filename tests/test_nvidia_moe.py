"""The NVIDIA backend's Triton routed experts (MXFP4 and float weights) against the torch reference MoE.

Natively on a GPU, in Triton's interpreter elsewhere (conftest turns it on); skipped without triton.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.quantization import quantize_fp4  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia import moe as moe_module  # noqa: E402
from deepinfer_nvidia import moe_blocks, moe_fp4_bytes  # noqa: E402
from deepinfer_nvidia.moe import LARGE_BM, SMALL_BM, TritonMoE, block_rows  # noqa: E402

BM = SMALL_BM

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (tokens, experts, top-k, hidden, intermediate, activation block)
SHAPES = [(5, 4, 2, 64, 32, 32), (19, 8, 2, 128, 64, 128), (1, 8, 3, 64, 64, 32)]
if CUDA:
    SHAPES += [(64, 16, 6, 1024, 512, 128), (300, 16, 6, 1024, 512, 32), (1, 64, 6, 2048, 1024, 128)]
# (expert weight format, activation dtype)
FORMATS = [("mxfp4", torch.float32), ("mxfp4", torch.bfloat16), (torch.float32, torch.float32),
           (torch.bfloat16, torch.bfloat16)]


def _experts(fmt, experts: int, hidden: int, inter: int, block: int, g: torch.Generator) -> ExpertWeights:
    def weight(rows, cols):
        return torch.randn(experts, rows, cols, generator=g) * cols**-0.5

    if fmt != "mxfp4":
        return ExpertWeights(*(weight(r, c).to(fmt).to(DEVICE) for r, c in ((inter, hidden),) * 2 + ((hidden, inter),)),
                             10.0)

    def packed(rows, cols):
        codes, scales = zip(*(quantize_fp4(w.to(DEVICE)) for w in weight(rows, cols)))
        return torch.stack(codes), torch.stack(scales)

    (w1, s1), (w3, s3), (w2, s2) = packed(inter, hidden), packed(inter, hidden), packed(hidden, inter)
    return ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, block)


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, dtype, g: torch.Generator):
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k]  # distinct experts per token
    return x.to(DEVICE), ids.to(DEVICE), torch.rand(tokens, top_k, generator=g).to(DEVICE)


def _check(ours: torch.Tensor, reference: torch.Tensor, fmt, dtype) -> None:
    assert ours.dtype == dtype and ours.shape == reference.shape and torch.isfinite(ours).all()
    # MXFP4 and fp32 weights: the same products in another fp32 summation order, tiny against the output's size.
    # bf16 weights on a GPU also round SwiGLU's fp32 output to bf16 (2^-9 relative per element) before w2.
    scale = reference.float().abs().amax()
    tolerance = (2**-7 if fmt == torch.bfloat16 else 1e-4) * scale
    if dtype == torch.bfloat16:
        tolerance = tolerance + reference.float().abs() * 2**-7  # plus one ulp of the output's dtype
    assert torch.all((ours.float() - reference.float()).abs() <= tolerance)


def _compare(weights: ExpertWeights, x, ids, topk_weights, fmt) -> None:
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)  # poison what the kernels allocate next
    reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)  # first: TritonMoE repacks MXFP4 in place
    _check(TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights), reference, fmt, x.dtype)


@pytest.mark.parametrize("fmt, dtype", FORMATS)
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, block", SHAPES)
def test_experts_match_the_reference(tokens, experts, top_k, hidden, inter, block, fmt, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    weights = _experts(fmt, experts, hidden, inter, block, g)
    _compare(weights, *_inputs(tokens, experts, top_k, hidden, dtype, g), fmt)


@pytest.mark.parametrize("fmt, dtype", FORMATS[1:])
def test_uneven_routing(fmt, dtype):
    """One expert gets more than BM rows (two blocks), most get none."""
    tokens, experts, hidden, inter = BM + 4, 8, 64, 32
    g = torch.Generator().manual_seed(7)
    weights = _experts(fmt, experts, hidden, inter, 32, g)
    x, _, topk_weights = _inputs(tokens, experts, 2, hidden, dtype, g)
    ids = torch.stack([torch.full((tokens,), 5), torch.randint(0, 2, (tokens,), generator=g) * 2], 1).to(DEVICE)
    _compare(weights, x, ids, topk_weights, fmt)


@pytest.mark.parametrize("fmt, dtype", FORMATS[1:])
def test_many_rows_per_expert_take_large_blocks(fmt, dtype):
    """A prefill-like batch (32+ rows per expert) runs the 64-row blocks: 2 full ones and partial ones."""
    tokens, experts, hidden, inter = 2 * LARGE_BM + 9, 4, 64, 32
    assert block_rows(tokens * 2, experts) == LARGE_BM
    g = torch.Generator().manual_seed(11)
    weights = _experts(fmt, experts, hidden, inter, 32, g)
    x, ids, topk_weights = _inputs(tokens, experts, 2, hidden, dtype, g)
    ids[:, 0] = 3  # expert 3 gets every token once: two full blocks and a partial one
    _compare(weights, x, ids, topk_weights, fmt)


@pytest.mark.parametrize("fmt, dtype", FORMATS[1:])
def test_no_tokens(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    weights = _experts(fmt, 4, 64, 32, 32, g)
    x, ids, topk_weights = _inputs(0, 4, 2, 64, dtype, g)
    out = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    assert out.shape == (0, 64) and out.dtype == dtype


@pytest.mark.parametrize("bm", [SMALL_BM, LARGE_BM])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 3), (5, 4, 2), (40, 8, 2), (300, 64, 6), (3, 256, 6)])
def test_blocks_cover_every_assignment_once(tokens, experts, top_k, bm):
    """The grid's size follows from shapes alone; its blocks with rows cover each expert's sorted rows exactly."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 1  # one popular expert: several blocks, one partial
    order, (expert, start, rows) = moe_blocks.sorted_blocks(ids.to(DEVICE), experts, bm)
    assignments = tokens * top_k
    assert len(expert) == -(-assignments // bm) + min(experts, assignments)
    sorted_ids = ids.flatten()[order.cpu()]
    covered = torch.zeros(assignments, dtype=torch.int64)
    for e, s, n in zip(expert.tolist(), start.tolist(), rows.tolist()):
        assert 0 <= n <= bm and 0 <= e < experts
        covered[s:s + n] += 1
        assert torch.all(sorted_ids[s:s + n] == e)
    assert torch.all(covered == 1)


@pytest.mark.parametrize("bm", [SMALL_BM, LARGE_BM])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 3), (5, 4, 2), (40, 8, 2), (3, 256, 6), (170, 256, 6),
                                                     (64, 384, 6)])
def test_one_launch_blocks_equal_the_sorted_ones(tokens, experts, top_k, bm):
    """The decode path's one-launch block table is ``sorted_blocks``'s exactly: stable order, every block (several
    programs from 64 assignments or blocks on)."""
    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = experts - 1  # a popular expert
    ids = ids.to(DEVICE)
    assert moe_blocks.serves(ids.numel())
    order, blocks = moe_blocks.sorted_blocks(ids, experts, bm)
    fused_order, token_of, sorted_rows, fused_blocks = moe_blocks.expert_blocks(ids, experts, bm)
    assert torch.equal(fused_order, order.int()) and torch.equal(token_of, (order // top_k).int())
    assert torch.equal(sorted_rows, torch.arange(ids.numel(), dtype=torch.int32, device=DEVICE))
    for fused, expected in zip(fused_blocks, blocks):
        assert torch.equal(fused, expected)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["mxfp4", torch.bfloat16])
def test_cuda_graph_replays_with_new_routing(fmt):
    tokens, experts, top_k, hidden, inter, block = 64, 16, 6, 512, 256, 128
    g = torch.Generator().manual_seed(11)
    weights = _experts(fmt, experts, hidden, inter, block, g)
    standard = dataclasses.replace(weights, w1=weights.w1.clone(), w3=weights.w3.clone(), w2=weights.w2.clone())
    x, ids, topk_weights = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
    moe = TritonMoE(TorchMoE())  # repacks MXFP4 weights in place: the reference reads the untouched copy
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels before the capture
        moe.routed_experts(x, ids, topk_weights, weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(x, ids, topk_weights, weights)
    _, random_ids, _ = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
    # every token's first choice is expert 0 (four blocks of BM rows); no expert above 8 gets a token
    skewed = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(8, generator=g)[:top_k - 1] + 1])
                          for _ in range(tokens)]).to(DEVICE)
    for new_ids in (random_ids, skewed):
        new_x, _, new_weights = _inputs(tokens, experts, top_k, hidden, torch.bfloat16, g)
        x.copy_(new_x)
        ids.copy_(new_ids)
        topk_weights.copy_(new_weights)
        graph.replay()
        _check(out, TorchMoE().routed_experts(x, ids, topk_weights, standard), fmt, torch.bfloat16)


@pytest.mark.parametrize("k, word_scales", [(64, False), (96, False), (192, False), (2048, False), (2048, True),
                                            (384, True)])
def test_autotuned_mxfp4_configs_tile_k(k, word_scales):
    """The tuner only times K tiles that divide K (K is passed as a keyword, so the pruner must read it there), and
    whole words of four scales (128 columns) when the kernel reads them so."""
    tuner = moe_fp4_bytes._tuned_fp4_experts()
    tuner.nargs = {}
    kept = tuner.prune_configs({"K": k, "N": 256, "BLOCK_M": BM, "SWIGLU": True, "WORD_SCALES": word_scales})
    assert kept and all(k % c.kwargs["BK"] == 0 for c in kept)
    assert not word_scales or all(c.kwargs["BK"] % 128 == 0 for c in kept)


def test_scales_are_read_four_to_a_word_only_when_their_rows_allow():
    scales = torch.zeros(3, 8, 40, dtype=torch.uint8)  # K = 1280: 40 scales a row
    assert moe_fp4_bytes._scale_words(scales, 1280).shape == (3, 8, 10)
    assert moe_fp4_bytes._scale_words(scales[..., :36], 1152).shape == (3, 8, 9)  # rows 40 bytes apart: still words
    assert moe_fp4_bytes._scale_words(torch.zeros(3, 8, 42, dtype=torch.uint8)[..., :40], 1280) is None  # 42 apart
    assert moe_fp4_bytes._scale_words(torch.zeros(3, 8, 3, dtype=torch.uint8), 96) is None  # K not whole words
    assert moe_fp4_bytes._scale_words(torch.zeros(3, 8, 41, dtype=torch.uint8)[..., 1:], 1280) is None  # misaligned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (7, 300), (0, 64)])
def test_shared_expert_swiglu_matches_the_reference(shape, dtype):
    """One launch: both inputs clamped (gate above, up both ways: the inputs reach past the limit) in fp32."""
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    gate, up = ((torch.randn(shape, generator=g) * 8).to(dtype).to(DEVICE) for _ in range(2))
    ours = moe_module.TritonMoE(reference=TorchMoE()).swiglu(gate, up, 7.0)
    assert ours.dtype == dtype and ours.shape == gate.shape
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(ours, TorchMoE().swiglu(gate, up, 7.0), **tolerance)


def test_shared_expert_swiglu_reads_the_halves_of_a_fused_projection():
    """gate and up as the column halves of one [T, 2I] GEMM output (``SharedInput``): read in place."""
    g = torch.Generator().manual_seed(4)
    fused = (torch.randn(5, 2 * 1100, generator=g) * 8).to(torch.bfloat16).to(DEVICE)
    gate, up = fused.split(1100, dim=-1)
    ours = moe_module.TritonMoE(reference=TorchMoE()).swiglu(gate, up, 7.0)
    assert ours.is_contiguous()
    torch.testing.assert_close(ours, TorchMoE().swiglu(gate.contiguous(), up.contiguous(), 7.0), rtol=2**-7,
                               atol=2**-7)
