"""fp32 logits from a bf16 head (``LinearBackend.logits``): the NVIDIA backend's Triton kernel and the torch
reference against an fp32 GEMM on the upcast weight.

On a GPU the kernel splits the hidden states into three bf16 terms for bf16 tensor cores; Triton's interpreter (on
a CPU) has no bf16 arithmetic and multiplies the same values in fp32. Skipped when triton is not installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "conftest.py turns Triton's interpreter on without a GPU"
pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime import ops  # noqa: E402
from deepinfer.plugins.builtin.torch_linear import TorchLinear  # noqa: E402
from deepinfer_nvidia.fp8_linear import TritonLinear  # noqa: E402
from deepinfer_nvidia.logits import bf16_logits  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (rows, vocab, width): decode and batch tiles, a vocabulary and a width that no tile divides
SHAPES = [(1, 100, 96), (5, 70, 64), (40, 33, 80)]
if CUDA:
    SHAPES += [(1, 129280, 5120), (64, 32000, 4096), (17, 3072, 256)]


def _inputs(rows: int, vocab: int, width: int):
    g = torch.Generator().manual_seed(rows + vocab + width)
    # hidden states over six decades: every one of the three bf16 terms matters
    hidden = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, width)
    weight = (torch.randn(vocab, width, generator=g) * width**-0.5).to(torch.bfloat16)
    return hidden.to(DEVICE), weight.to(DEVICE)


def _check(ours: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    expected = hidden.double() @ weight.double().T
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    # fp32 summation of exact products: a few fp32 roundings of the row's absolute dot products
    bound = 2**-20 * (hidden.double().abs() @ weight.double().abs().T)
    assert torch.all((ours.double() - expected).abs() <= bound)


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("rows, vocab, width", SHAPES)
def test_bf16_logits_are_fp32_products(rows, vocab, width, pinned):
    hidden, weight = _inputs(rows, vocab, width)
    if CUDA:
        torch.full((1 << 26,), float("nan"), device=DEVICE)  # poison what the kernel allocates next
    _check(bf16_logits(hidden, weight, pinned), hidden, weight)


@pytest.mark.skipif(not CUDA, reason="the interpreter's fp32 dot is numpy's, whose sums depend on a row's place")
def test_pinned_logits_do_not_depend_on_the_batch():
    """Batch-invariant mode: a row's logits are the same bits alone and among 40 rows."""
    hidden, weight = _inputs(40, 300, 128)
    alone = torch.cat([bf16_logits(hidden[i:i + 1], weight, pinned=True) for i in (0, 17, 39)])
    together = bf16_logits(hidden, weight, pinned=True)[[0, 17, 39]]
    assert torch.equal(alone, together)


def test_bf16_logits_refuse_other_dtypes():
    hidden, weight = _inputs(2, 8, 32)
    with pytest.raises(ValueError, match="fp32 hidden states and a bf16 weight"):
        bf16_logits(hidden, weight.float())
    with pytest.raises(ValueError, match="fp32 hidden states and a bf16 weight"):
        bf16_logits(hidden.bfloat16(), weight)


@pytest.mark.parametrize("backend", [TorchLinear(), TritonLinear()])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backends_serve_every_float_head(backend, dtype, monkeypatch):
    """bf16 heads by the kernel (NVIDIA), the others by one fp32 GEMM or slabs of upcast rows (three slabs
    here)."""
    monkeypatch.setattr(ops, "_UPCAST_ROWS", 16)
    hidden, weight = _inputs(3, 40, 64)
    weight = weight.to(dtype)
    _check(backend.logits(hidden, weight), hidden, weight)
