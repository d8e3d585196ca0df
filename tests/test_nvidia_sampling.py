"""The NVIDIA plugin's greedy tokens (two Triton launches) against torch's argmax: fresh random rows, ties, NaN and
rows of -inf (natively on a GPU, else Triton's interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer_nvidia import plugin  # noqa: E402
from deepinfer_nvidia.sampling import CHUNK, greedy_tokens  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# a row shorter than a chunk, one chunk and a bit, an odd width; on a GPU V4.1's vocabulary
SHAPES = [(1, 7), (3, CHUNK + 5), (5, 3 * CHUNK - 1)] + ([(1, 129280), (64, 129280)] if CUDA else [])


@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_greedy_tokens_are_torchs_argmax(rows, vocab):
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)) * 4).to(DEVICE)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("rows, vocab", SHAPES)
def test_ties_go_to_the_first_index_and_nan_wins(rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g)
    # every row: its maximum written again at later columns; one row of -inf; one with NaNs after a +inf
    peak = logits.max(dim=-1, keepdim=True).values
    for column in sorted(torch.randint(0, vocab, (3,), generator=g).tolist()):
        logits[:, column:column + 1] = peak
    logits[0] = float("-inf")
    if rows > 1:
        logits[1, vocab // 3] = float("inf")
        logits[1, vocab // 2] = logits[1, vocab - 1] = float("nan")
    logits = logits.to(DEVICE)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_greedy_tokens_refuse_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="fp32"):
        greedy_tokens(torch.randn(2, 10, device=DEVICE).half())
    with pytest.raises(ValueError, match="unit-stride"):
        greedy_tokens(torch.randn(2, 10, device=DEVICE)[:, ::2])
    with pytest.raises(ValueError, match="empty vocabulary"):
        greedy_tokens(torch.empty(2, 0, device=DEVICE))
    assert greedy_tokens(torch.empty(0, 10, device=DEVICE)).shape == (0,)


def test_the_plugin_samples_with_it_on_cuda_only():
    sampler = plugin.deepinfer_sampler(config=None, device=torch.device("cuda"))
    assert sampler.greedy is greedy_tokens and "Triton argmax" in sampler.name
    assert plugin.deepinfer_sampler(config=None, device=torch.device("cpu")) is None
