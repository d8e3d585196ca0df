"""The NVIDIA backend's fused mHC weights against the torch reference (natively on a GPU, else the interpreter)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))  # when not pip-installed

from deepinfer.runtime.ops import mhc_coefficients, mhc_collapse, mhc_expand  # noqa: E402
from deepinfer.plugins.builtin.torch_mhc import TorchMHC  # noqa: E402
from deepinfer_nvidia.mhc import GEMM_TOKENS, ONE_PASS_MAX_WIDTH, TritonMHC  # noqa: E402

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


def _mix_inputs(tokens: int, n: int, width: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Streams [T, n, D] and a sublayer's fn, base and scale at a trained model's magnitudes."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 + n) * n
    streams = (torch.randn(tokens, n, width, generator=g) * 2).to(dtype)
    fn = torch.randn(logits, n * width, generator=g) * 0.01
    base, scale = torch.randn(logits, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5
    return [t.to(DEVICE) for t in (streams, fn, base, scale)]


# the default, and 1: every call's projection is the prefill's tiled kernel
GEMM_PATHS = [GEMM_TOKENS, 1]


@pytest.mark.parametrize("gemm_tokens", GEMM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, width", [(1, 4, 100), (37, 4, 100), (5, 2, 300), (17, 2, 64), (0, 4, 64),
                                              (2, 4, 2100), (70, 4, 100)])
def test_weights_match_the_reference(tokens, n, width, dtype, gemm_tokens):
    """The projection split over K (n * width: no multiple of the split, or two column blocks a split at 2100),
    or in tiles of tokens (70: a second, partial tile), summed with the Sinkhorn in a second launch, against ``runtime.ops.mhc_logits`` and the reference
    coefficients."""
    streams, fn, base, scale = _mix_inputs(tokens, n, width, dtype, seed=tokens * 11 + width)
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the outputs below reuse poisoned memory
    ours = TritonMHC(gemm_tokens).weights(streams, fn, base, scale, n, 20, 1e-6, 1e-6)
    reference = TorchMHC().weights(streams, fn, base, scale, n, 20, 1e-6, 1e-6)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_weights_do_not_depend_on_its_batch(dtype):
    """Bitwise, alone or among 37 tokens (three token blocks), first in its block or not: the K-splits follow the
    width, not the token count. Only without the prefill's GEMM, which batch-invariant mode turns off."""
    assert TritonMHC(gemm_tokens=None).batch_invariant and not TritonMHC().batch_invariant
    mhc = TritonMHC(gemm_tokens=None)
    streams, fn, base, scale = _mix_inputs(37, 4, 100, dtype, seed=3)
    batched = mhc.weights(streams, fn, base, scale, 4, 20, 1e-6, 1e-6)
    for token in (0, 20):
        alone = mhc.weights(streams[token:token + 1], fn, base, scale, 4, 20, 1e-6, 1e-6)
        assert all(torch.equal(a[0], b[token]) for a, b in zip(alone, batched)), token


@pytest.mark.parametrize("gemm_tokens", GEMM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, width, normed", [(1, 4, 100, True), (37, 4, 100, True), (5, 2, 300, False),
                                                      (0, 4, 64, True), (2, 4, 2100, True)])
def test_sublayer_input_is_the_weights_then_the_collapse(tokens, n, width, normed, dtype, gemm_tokens):
    """One launch for the coefficients and the collapse (and the input norm) per token, against the reference's
    ``weights`` then ``collapse``."""
    streams, fn, base, scale = _mix_inputs(tokens, n, width, dtype, seed=tokens * 5 + width)
    weight = torch.rand(width, generator=torch.Generator().manual_seed(width)).add(0.5).to(DEVICE) if normed else None
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the outputs below reuse poisoned memory
    x, post, comb = TritonMHC(gemm_tokens).sublayer_input(streams, fn, base, scale, n, 20, 1e-6, 1e-6, weight, 1e-6)
    ref_x, ref_post, ref_comb = TorchMHC().sublayer_input(streams, fn, base, scale, n, 20, 1e-6, 1e-6, weight, 1e-6)
    assert x.shape == (tokens, width) and x.dtype == dtype
    _, weights_post, weights_comb = TritonMHC(gemm_tokens).weights(streams, fn, base, scale, n, 20, 1e-6, 1e-6)
    # as ``weights`` gives them, up to the Sinkhorn's reduction order (this launch has more warps a program)
    torch.testing.assert_close(post, weights_post, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(comb, weights_comb, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-6)
    # the reference rounds the bf16 sum before the norm, the kernel does not
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(x, ref_x, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, width", [(1, 4, 100), (37, 4, 100), (5, 2, 300), (0, 4, 64), (2, 4, 2100)])
def test_single_pass_input_collapses_with_the_previous_pre(tokens, n, width, dtype):
    """V4.1's sublayer input: this sublayer's coefficients, and the streams collapsed with the previous sublayer's
    ``pre`` in the same launch, exactly as ``collapse`` does it alone."""
    streams, fn, base, scale = _mix_inputs(tokens, n, width, dtype, seed=tokens * 3 + width)
    g = torch.Generator().manual_seed(width + 1)
    previous_pre = (torch.rand(tokens, n, generator=g) + 0.1).to(DEVICE)
    weight = torch.rand(width, generator=g).add(0.5).to(DEVICE)
    if DEVICE.type == "cuda":
        torch.full((1 << 24,), float("nan"), device=DEVICE)  # freed at once: the outputs below reuse poisoned memory
    mhc = TritonMHC()
    x, pre, post, comb = mhc.single_pass_input(streams, previous_pre, fn, base, scale, n, 20, 1e-6, 1e-6, weight, 1e-6)
    assert x.shape == (tokens, width) and x.dtype == dtype and pre.shape == post.shape == (tokens, n)
    assert torch.equal(x, mhc.collapse(streams, previous_pre, weight, 1e-6))
    ref_x, *ref_weights = TorchMHC().single_pass_input(streams, previous_pre, fn, base, scale, n, 20, 1e-6, 1e-6,
                                                       weight, 1e-6)
    for ours, own_launch, reference in zip((pre, post, comb), mhc.weights(streams, fn, base, scale, n, 20, 1e-6, 1e-6),
                                           ref_weights):
        torch.testing.assert_close(ours, own_launch, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    if tokens:  # the collapse used the previous pre, not this one
        assert not torch.equal(x, mhc.collapse(streams, pre, weight, 1e-6))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(x, ref_x, **tolerance)


@pytest.mark.parametrize("tokens, width", [(1, 100), (2, 2100), (2, 5120)])
def test_single_pass_input_in_one_launch_matches_two(tokens, width, monkeypatch):
    """Up to ONE_LAUNCH_MAX_TOKENS (off until timed; here ONE_LAUNCH_BUILT_FOR) tokens V4.1's sublayer input is one
    launch whose last-arriving split computes the
    coefficients: the same collapse bit for bit and the same coefficients (to fp32 rounding: its splits reduce with
    the collapse's warps) as the two launches, its arrival counter back at zero, and a second call equal to the
    first. Batch-invariant mode keeps the two launches."""
    from deepinfer_nvidia import mhc
    from deepinfer_nvidia.split_k import counters_are_zero

    n = 4
    streams, fn, base, scale = _mix_inputs(tokens, n, width, torch.bfloat16, seed=width)
    g = torch.Generator().manual_seed(width + 2)
    previous_pre = (torch.rand(tokens, n, generator=g) + 0.1).to(DEVICE)
    weight = torch.rand(width, generator=g).add(0.5).to(DEVICE)
    args = (streams, previous_pre, fn, base, scale, n, 20, 1e-6, 1e-6, weight, 1e-6)
    monkeypatch.setattr(mhc, "ONE_LAUNCH_MAX_TOKENS", mhc.ONE_LAUNCH_BUILT_FOR)
    launches = []
    real = mhc._single_pass_input_kernel
    monkeypatch.setattr(mhc, "_single_pass_input_kernel", _Recorder(real, launches))
    one = TritonMHC().single_pass_input(*args)
    assert len(launches) == 1 and counters_are_zero(streams.device)
    assert all(torch.equal(a, b) for a, b in zip(one, TritonMHC().single_pass_input(*args)))
    assert len(TritonMHC(gemm_tokens=None).single_pass_input(*args)) == 4 and len(launches) == 2  # invariant: two
    monkeypatch.setattr(mhc, "ONE_LAUNCH_MAX_TOKENS", 0)
    two = TritonMHC().single_pass_input(*args)
    assert len(launches) == 2
    assert torch.equal(one[0], two[0])
    for ours, theirs in zip(one[1:], two[1:]):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


class _Recorder:
    """A Triton kernel whose launches are counted (``kernel[grid](...)``)."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def test_weights_refuse_what_the_kernels_cannot_read():
    streams, fn, base, scale = _mix_inputs(3, 4, 64, torch.bfloat16, seed=4)
    with pytest.raises(ValueError, match="contiguous fp32"):
        TritonMHC().weights(streams, fn.half(), base, scale, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="strided"):
        TritonMHC().weights(streams, fn.T.contiguous().T, base, scale, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"\[24, 256\]"):
        TritonMHC().weights(streams, fn[:, :128], base, scale, 4, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="hc_mult = 2"):
        TritonMHC().weights(streams, fn, base, scale, 2, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="base and scale"):
        TritonMHC().weights(streams, fn, base[:8], scale, 4, 20, 1e-6, 1e-6)


def test_weights_read_strided_streams():
    streams, fn, base, scale = _mix_inputs(3, 4, 128, torch.float32, seed=5)
    strided, fn = streams[:, :, ::2], fn[:, :256].contiguous()  # the channels no longer unit-stride: copied once
    ours = TritonMHC().weights(strided, fn, base, scale, 4, 20, 1e-6, 1e-6)
    for a, b in zip(ours, TorchMHC().weights(strided, fn, base, scale, 4, 20, 1e-6, 1e-6)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, width", [(1, 4, 64), (9, 4, 96), (3, 2, 2048), (2, 4, 3000), (0, 4, 64),
                                              (2, 2, ONE_PASS_MAX_WIDTH + 100)])
def test_collapse_and_expand_match_the_reference(tokens, n, width, dtype):
    """In fp32 rounded once, as ``runtime.ops`` computes them; the collapse in one read of a row, or in two passes
    of tiles over rows wider than ``ONE_PASS_MAX_WIDTH``."""
    g = torch.Generator().manual_seed(tokens * 13 + width)
    streams = torch.randn(tokens, n, width, generator=g).to(dtype).to(DEVICE)
    output = torch.randn(tokens, width, generator=g).to(dtype).to(DEVICE)
    logits = (torch.randn(tokens, (2 + n) * n, generator=g) * 3).to(DEVICE)
    pre, post, comb = mhc_coefficients(logits, n, 20, 1e-6)
    backend = TritonMHC()
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    collapsed = backend.collapse(streams, pre)
    assert collapsed.dtype == dtype
    torch.testing.assert_close(collapsed, mhc_collapse(streams, pre), **tolerance)
    weight = (torch.rand(width, generator=g) + 0.5).to(DEVICE)  # the sublayer's input norm, fused
    normed = backend.collapse(streams, pre, weight, 1e-6)
    if dtype == torch.bfloat16:  # the reference rounds the sum to bf16 before the norm, the kernel does not
        tolerance = {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(normed, mhc_collapse(streams, pre, weight, 1e-6), **tolerance)
    expanded = backend.expand(streams, output, post, comb)
    assert expanded.shape == (tokens, n, width) and expanded.dtype == dtype
    torch.testing.assert_close(expanded, mhc_expand(streams, output, post, comb), **tolerance)


def test_collapse_refuses_odd_stream_counts_and_half_weights():
    with pytest.raises(ValueError, match="power-of-two stream count"):
        TritonMHC().collapse(torch.randn(2, 3, 64, device=DEVICE), torch.rand(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="must be fp32"):
        TritonMHC().collapse(torch.randn(2, 4, 64, device=DEVICE), torch.rand(2, 4, device=DEVICE).half())


def test_strided_weights_are_read_as_given():
    g = torch.Generator().manual_seed(5)
    streams = torch.randn(3, 4, 64, generator=g).to(DEVICE)
    pre = torch.rand(4, 3, generator=g).to(DEVICE).T  # a transposed view
    torch.testing.assert_close(TritonMHC().collapse(streams, pre), mhc_collapse(streams, pre), rtol=1e-5, atol=1e-5)


def _engram_inputs(tokens: int, n: int, width: int, dtype: torch.dtype, seed: int):
    """Streams, and key and value as the Engram's projection returns them: views of one [T, (n + 1) D] output."""
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(tokens, n, width, generator=g) * 2).to(dtype)
    projected = torch.randn(tokens, (n + 1) * width, generator=g).to(dtype)
    key, value = projected.split((n * width, width), dim=-1)
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, n, width, generator=g)).to(dtype).unbind(0)
    return [t.to(DEVICE) for t in (streams, key.unflatten(-1, (n, width)), value, q_weight, k_weight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, width", [(1, 4, 5120), (3, 4, 100), (37, 2, 64), (0, 4, 64), (2, 4, 9000)])
def test_engram_gate_matches_the_reference(tokens, n, width, dtype):
    streams, key, value, q_weight, k_weight = _engram_inputs(tokens, n, width, dtype, seed=tokens + width)
    ours = TritonMHC().engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    reference = TorchMHC().engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    assert ours.shape == (tokens, n, width) and ours.dtype == dtype
    # the gates agree to fp32 rounding; a bf16 output may then round one way or the other
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(ours, reference, **tolerance)
    if tokens:  # the gate moved the streams: the check above would not notice a kernel that returned its input
        assert (reference.float() - streams.float()).abs().max() > 0.1


def test_engram_gate_replays_in_a_cuda_graph():
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    streams, key, value, q_weight, k_weight = _engram_inputs(2, 4, 5120, torch.bfloat16, seed=5)
    mhc = TritonMHC()
    eager = mhc.engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = mhc.engram_gate(streams, key, value, q_weight, k_weight, 1e-6)
    graph.replay()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
