"""The NVIDIA backend's fused mHC coefficients against the torch reference (natively on a GPU, else the interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.core.ops import mhc_coefficients  # noqa: E402
from deepinfer_nvidia.mhc import TritonMHC  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("tokens, n, iters", [(1, 4, 20), (37, 4, 20), (5, 2, 3), (0, 4, 20), (16, 4, 1)])
def test_coefficients_match_the_reference(tokens, n, iters):
    g = torch.Generator().manual_seed(tokens * 7 + n)
    logits = (torch.randn(tokens, (2 + n) * n, generator=g) * 3).to(DEVICE)
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the outputs below reuse poisoned memory
    ours = TritonMHC().coefficients(logits, n, iters, 1e-6)
    reference = mhc_coefficients(logits, n, iters, 1e-6)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_strided_or_half_logits_are_refused():
    logits = torch.randn(3, 48, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="unit-stride"):
        TritonMHC().coefficients(logits, 4, 20, 1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        TritonMHC().coefficients(torch.randn(3, 15, device=DEVICE), 3, 20, 1e-6)
