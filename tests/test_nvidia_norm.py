"""The NVIDIA backend's one-launch RMSNorm against ``deepinfer.runtime.ops.rms_norm`` (natively on a GPU, else Triton's
interpreter) on fresh random rows, weighted and not, in bf16 and fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.ops import rms_norm  # noqa: E402
from deepinfer_nvidia.norm import rms_norm as triton_rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (5, 3, 96), (7, 1000), (0, 64)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_the_reference(shape, dtype, weighted):
    g = torch.Generator().manual_seed(shape[0] * 31 + shape[-1])
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype).to(DEVICE)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE) if weighted else None
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the output reuses poisoned memory
    ours = triton_rms_norm(x, weight, 1e-6)
    assert ours.dtype == dtype and ours.shape == x.shape
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(ours, rms_norm(x, weight, 1e-6), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_the_column_slice_of_a_fused_projection(dtype):
    """Rows with a stride (one projection's columns of a fused GEMM's output) are read in place."""
    g = torch.Generator().manual_seed(3)
    fused = (torch.randn(6, 96 + 40, generator=g) * 2).to(dtype).to(DEVICE)
    x = fused[:, 96:]
    weight = (torch.rand(40, generator=g) + 0.5).to(DEVICE)
    ours = triton_rms_norm(x, weight, 1e-6)
    assert ours.is_contiguous() and ours.shape == x.shape
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(ours, rms_norm(x.contiguous(), weight, 1e-6), **tolerance)


def test_a_wrong_weight_is_refused():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        triton_rms_norm(x, torch.ones(8, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"\[8\]"):
        triton_rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
