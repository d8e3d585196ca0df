"""The NVIDIA backend's one-launch V4.1 cache roundings against ``deepinfer.runtime.cache_formats`` (natively on a GPU,
else Triton's interpreter): bit for bit, on fresh random rows over several decades, partial last groups, exact
e2m1 midpoints, zero groups and scales past e4m3's range."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.cache_formats import round_to_format  # noqa: E402
from deepinfer_nvidia.cache_formats import round_to_format as triton_round  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = ["fp8", "mxfp4", "nvfp4"]


def _rows(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    decades = torch.logspace(-3, 3, shape[-1])[torch.randperm(shape[-1], generator=g)]  # channels at many scales
    return (torch.randn(shape, generator=g) * decades).to(dtype).to(DEVICE)


def _assert_bitwise(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert torch.equal(ours.view(torch.int16 if ours.element_size() == 2 else torch.int32),
                       reference.view(torch.int16 if reference.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (7, 3, 128), (5, 100), (2, 1000), (0, 64)])
def test_rounding_matches_the_reference_bit_for_bit(fmt, dtype, shape):
    x = _rows(shape, dtype, seed=shape[-1] + len(fmt))
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the output reuses poisoned memory
    _assert_bitwise(triton_round(x, fmt), round_to_format(x, fmt))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_e2m1_midpoints_round_to_the_even_code(fmt):
    """Groups whose amax is 6 (scale 1): every midpoint of the e2m1 grid, both signs, and values beside them."""
    group = 32 if fmt == "mxfp4" else 16
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    values = torch.cat([midpoints, -midpoints, midpoints + 1e-3, midpoints - 1e-3, torch.tensor([6.0, -0.1, 0.0])])
    values = torch.nn.functional.pad(values, (0, -values.numel() % group), value=6.0)
    x = values.view(1, -1).to(DEVICE)
    _assert_bitwise(triton_round(x, fmt), round_to_format(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_groups_tiny_and_huge_magnitudes(fmt):
    x = torch.zeros(4, 64)
    x[1] = 1e-30  # below every scale floor
    x[2] = torch.linspace(-3e4, 3e4, 64)  # NVFP4's e4m3 scale saturates at 448
    x[3, :17] = torch.randn(17) * 1e-6
    x = x.to(DEVICE)
    _assert_bitwise(triton_round(x, fmt), round_to_format(x, fmt))


def test_unknown_formats_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="unknown cache format 'int4'"):
        triton_round(torch.zeros(1, 32, device=DEVICE), "int4")
    with pytest.raises(ValueError, match="unknown cache format"):
        round_to_format(torch.zeros(1, 32), "int4")
    with pytest.raises(ValueError, match="int64"):
        triton_round(torch.zeros(1, 32, dtype=torch.int64, device=DEVICE), "fp8")
