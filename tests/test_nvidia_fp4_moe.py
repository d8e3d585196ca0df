"""The NVIDIA backend's Triton MXFP4 routed experts against the torch reference MoE.

Natively on a GPU, in Triton's interpreter elsewhere (conftest turns it on); skipped without triton.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.core.quantization import quantize_fp4  # noqa: E402
from deepinfer.plugins.builtin.torch_moe import TorchMoE  # noqa: E402
from deepinfer.plugins.interfaces import ExpertWeights  # noqa: E402
from deepinfer_nvidia.fp4_moe import TritonMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (tokens, experts, top-k, hidden, intermediate, activation block)
SHAPES = [(5, 4, 2, 64, 32, 32), (19, 8, 2, 128, 64, 128), (1, 8, 3, 64, 64, 32)]
if CUDA:
    SHAPES += [(64, 16, 6, 1024, 512, 128), (300, 16, 6, 1024, 512, 32), (1, 64, 6, 2048, 1024, 128)]


def _stack(experts: int, rows: int, cols: int, g: torch.Generator):
    packed, scales = zip(*(quantize_fp4((torch.randn(rows, cols, generator=g) * cols**-0.5).to(DEVICE))
                           for _ in range(experts)))
    return torch.stack(packed), torch.stack(scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, block", SHAPES)
def test_fp4_experts_match_the_reference(tokens, experts, top_k, hidden, inter, block, dtype):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    (w1, s1), (w3, s3), (w2, s2) = (_stack(experts, inter, hidden, g), _stack(experts, inter, hidden, g),
                                    _stack(experts, hidden, inter, g))
    weights = ExpertWeights(w1, w3, w2, 10.0, s1, s3, s2, block)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    topk_weights = torch.rand(tokens, top_k, generator=g).to(DEVICE)
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)  # poison what the kernels allocate next
    ours = TritonMoE(TorchMoE()).routed_experts(x, ids, topk_weights, weights)
    reference = TorchMoE().routed_experts(x, ids, topk_weights, weights)
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    # same products in another summation order (fp32): tiny against the output's size, plus one ulp of its dtype
    scale = reference.float().abs().amax()
    tolerance = 1e-4 * scale + (reference.float().abs() * 2**-7 if dtype == torch.bfloat16 else 0)
    assert torch.all((ours.float() - reference.float()).abs() <= tolerance)
