"""Batch-invariant mode (``features/batch_invariant``, ``DEEPINFER_BATCH_INVARIANT=1``): one request's tokens and
logprobs are bitwise the same whatever shares its batch, wherever it sits in it and however its prompt is chunked;
``seq_seed`` samples repeat across batches. On CPU here and on CUDA where there is a GPU (with the NVIDIA backend's
pinned kernels and CUDA graphs)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer import LLM, SamplingParams, envs
from deepinfer.runner.sampling_batch import GOLDEN
from deepinfer.plugins import hookimpl
from deepinfer.plugins.builtin.torch_attention import TorchAttention
from deepinfer.plugins.manager import PluginError, registered
from deepinfer.testing.batch_mates import TARGET, outputs_among_random_batches

pytest.importorskip("deepinfer_batch_invariant.plugin", reason="features/batch_invariant is not installed (build.sh)")
from deepinfer_batch_invariant import cpu_checks  # noqa: E402
from deepinfer_batch_invariant.attention import KEY_BLOCK, BlockedTorchAttention  # noqa: E402
from deepinfer_batch_invariant.fixed_tiles import FixedRowTiles, _einsum_token_dim  # noqa: E402

V41_FIXTURE = Path(__file__).parent / "fixtures" / "v41_tiny"
# the mode refuses to start on a CPU whose kernels break what it rests on (cpu_checks); there it has nothing to test
CPU_PROBLEMS = cpu_checks.cpu_problems(16)
cpu_holds = pytest.mark.skipif(bool(CPU_PROBLEMS), reason="; ".join(CPU_PROBLEMS))
DEVICES = [pytest.param("cpu", marks=cpu_holds)]
DEVICES += ["cuda"] if torch.cuda.is_available() else []


@contextlib.contextmanager
def _plugins(device: str, monkeypatch, invariant: bool = True):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    envs.reload()
    with contextlib.ExitStack() as stack:
        stack.enter_context(registered(importlib.import_module("deepinfer_batch_invariant.plugin"), "batch_invariant"))
        if device == "cuda":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))
            stack.enter_context(registered(importlib.import_module("deepinfer_nvidia.plugin"), "nvidia"))
        yield


def _maker(model: str, device: str, monkeypatch, invariant: bool = True, **engine_args):
    def make_llm(**more):
        with _plugins(device, monkeypatch, invariant):
            return LLM(model, dtype="float32", device=device, max_num_seqs=8, **engine_args, **more)
    return make_llm


@pytest.mark.parametrize("device", DEVICES)
def test_one_request_gives_one_output_in_100_random_batches(tiny_v4_checkpoint, monkeypatch, device):
    outputs = outputs_among_random_batches(_maker(str(tiny_v4_checkpoint), device, monkeypatch), runs=100)
    assert len(outputs) == 1, f"{len(outputs)} different outputs in 100 runs: {sorted(outputs.values())}"


@pytest.mark.parametrize("device", DEVICES)
def test_v41_request_gives_one_output_in_random_batches(monkeypatch, device):
    outputs = outputs_among_random_batches(_maker(str(V41_FIXTURE), device, monkeypatch), runs=8, seed=1)
    assert len(outputs) == 1, f"{len(outputs)} different outputs in 8 runs: {sorted(outputs.values())}"


@cpu_holds
def test_without_the_mode_the_same_batches_change_the_output(tiny_v4_checkpoint, monkeypatch):
    """The harness can fail: without the mode, batch mates move the target's logprobs."""
    outputs = outputs_among_random_batches(_maker(str(tiny_v4_checkpoint), "cpu", monkeypatch, invariant=False),
                                            runs=12)
    assert len(outputs) > 1


def _sampled(llm, seed: int, mates: list[str], n: int = 1):
    params = SamplingParams(temperature=1.5, seq_seed=seed, n=n, max_tokens=16, ignore_eos=True)
    results = llm.generate([TARGET] + mates, [params] + [SamplingParams(max_tokens=5)] * len(mates), use_tqdm=False)
    return [c.token_ids for c in results[0].outputs]


@pytest.mark.parametrize("device", DEVICES)
def test_seq_seed_samples_repeat_across_batches_and_differ_between_seeds(tiny_v4_checkpoint, monkeypatch, device):
    llm = _maker(str(tiny_v4_checkpoint), device, monkeypatch, max_num_batched_tokens=32)()
    alone = _sampled(llm, 7, [])
    assert _sampled(llm, 7, ["a mate", "and another mate with a longer prompt " * 3]) == alone
    assert _sampled(llm, 8, ["a mate"]) != alone
    # n > 1: sample i draws with seed + i * GOLDEN (mod 2**63), so sample 0 is the n = 1 sample of the same seed
    first, second = _sampled(llm, 7, ["x y z"], n=2)
    assert [first] == alone and first != second
    assert [second] == _sampled(llm, (7 + GOLDEN) % 2**63, [])


def test_combinations_that_cannot_be_invariant_are_refused(tiny_v4_checkpoint, monkeypatch):
    pytest.importorskip("deepinfer_mtp.plugin", reason="features/mtp is not installed")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    with registered(importlib.import_module("deepinfer_mtp.plugin"), "mtp"):
        with pytest.raises(PluginError, match="DEEPINFER_ENABLE_MTP_VARLEN=1 schedules each request's draft length"):
            _maker(str(tiny_v4_checkpoint), "cpu", monkeypatch)()


def test_a_cpu_that_breaks_the_modes_assumptions_is_refused(tiny_v4_checkpoint, monkeypatch):
    assert cpu_checks.cpu_problems.__wrapped__(16) == CPU_PROBLEMS  # the checks are repeatable
    monkeypatch.setattr(cpu_checks, "cpu_problems", lambda rows: ["exp rounds an element differently"])
    with pytest.raises(PluginError, match="cannot hold on this CPU: exp rounds an element differently"):
        _maker(str(tiny_v4_checkpoint), "cpu", monkeypatch)()


def test_backends_that_do_not_declare_invariance_are_refused(tiny_v4_checkpoint, monkeypatch):
    class PaddedWidth(TorchAttention):  # the reference reduces over the padded width: it declares False
        name = "padded-width"

    class Offers:
        @hookimpl(tryfirst=True)
        def deepinfer_attention_backend(self, config, device):
            return PaddedWidth()

    with registered(Offers(), "padded-width"):
        with pytest.raises(ValueError, match="attention backend 'padded-width' do not declare batch_invariant = True"):
            _maker(str(tiny_v4_checkpoint), "cpu", monkeypatch)()


# --- the pieces, on fresh random inputs

@cpu_holds
def test_row_tiles_make_a_rows_product_independent_of_the_row_count():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(192, 256, generator=g)
    grouped = torch.randn(4, 24, 64, generator=g)
    with FixedRowTiles(16, tile_reductions=True, exact_tails=True):
        rows = {m: (F.linear(x[:m], w)[0], (x[:m] @ w.T)[0], torch.einsum("tgd,grd->tgr", x[:m].view(m, 4, 64),
                                                                          grouped)[0], x[:m].softmax(-1)[0])
                for m in (1, 2, 7, 16, 17, 100, 300)}
    for m, results in rows.items():
        assert all(torch.equal(a, b) for a, b in zip(results, rows[1])), m
    expected = (x @ w.T)[0]
    torch.testing.assert_close(rows[300][0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation, expected", [("tgd,grd->tgr", 0), ("td,nd->nt", 1), ("thd,tkd->thk", None),
                                                ("...d,nd->...n", None), ("ttd,d->t", None), ("d,nd->n", None)])
def test_einsum_row_index(equation, expected):
    assert _einsum_token_dim(equation) == expected


@cpu_holds
@pytest.mark.parametrize("name, function", [("sigmoid", torch.sigmoid), ("silu", F.silu), ("softplus", F.softplus)])
def test_tail_safe_functions(name, function):
    """Close to torch's, and an element's value does not depend on where the vector loop ends."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * 8
    with FixedRowTiles(16, tile_reductions=False, exact_tails=True):
        ours = function(x)
        ends = [function(x[:n])[n - 1] for n in range(33, 97)]
    torch.testing.assert_close(ours, function(x), rtol=2e-6, atol=1e-7)
    assert all(torch.equal(value, ours[n - 1]) for n, value in zip(range(33, 97), ends))


def _attention_case(g, tokens=5, heads=4, dim=32, rows=300):
    pool = torch.randn(rows, dim, generator=g)
    q = torch.randn(tokens, heads, dim, generator=g)
    sinks = torch.randn(heads, generator=g)
    window = torch.randint(0, rows, (tokens, 13), generator=g)
    entries = torch.randint(0, rows, (tokens, 70), generator=g).masked_fill(torch.rand(tokens, 70, generator=g) < .3, -1)
    return q, pool, sinks, window, entries


def test_blocked_attention_matches_the_reference_and_ignores_padding():
    g = torch.Generator().manual_seed(2)
    q, pool, sinks, window, entries = _attention_case(g)
    blocked = BlockedTorchAttention()
    ours = blocked.sparse_attention(q, [(pool, window), (pool, entries)], sinks, 0.2)
    torch.testing.assert_close(ours, TorchAttention().sparse_attention(q, [(pool, window), (pool, entries)], sinks, 0.2),
                               rtol=1e-5, atol=1e-6)
    for extra in (1, 7, KEY_BLOCK, 3 * KEY_BLOCK + 5):  # a wider batch pads every index list
        padded = F.pad(entries, (0, extra), value=-1)
        assert torch.equal(blocked.sparse_attention(q, [(pool, window), (pool, padded)], sinks, 0.2), ours)
    assert torch.equal(blocked.sparse_attention(q[:1], [(pool, window[:1]), (pool, entries[:1])], sinks, 0.2), ours[:1])

    weights = torch.randn(q.shape[0], q.shape[1], generator=g)
    scores = blocked.indexer_scores(q, weights, pool, entries)
    torch.testing.assert_close(scores, TorchAttention().indexer_scores(q, weights, pool, entries), rtol=1e-5, atol=1e-5)
    wider = blocked.indexer_scores(q, weights, pool, F.pad(entries, (0, 100), value=-1))
    assert torch.equal(wider[:, :entries.shape[1]], scores)
