"""Projections of one input fused into one GEMM per weight format (``deepinfer.runtime.linear.SharedInput``), and the
V4 indexer, which skips scoring when every candidate fits its top-k (two ways a decode step sheds launches)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepinfer.runtime.linear import Linear, SharedInput
from deepinfer.runtime.quantization import quantize_fp4, quantize_fp8
from deepinfer.plugins.builtin.torch_linear import TorchLinear


def _float(rows: int, cols: int, dtype: torch.dtype, g: torch.Generator) -> nn.Linear:
    module = nn.Linear(cols, rows, bias=False, dtype=dtype)
    module.weight.data = torch.randn(rows, cols, generator=g).to(dtype)
    return module


def _quantized(rows: int, cols: int, fmt: str, g: torch.Generator) -> Linear:
    module = Linear(cols, rows)
    w = torch.randn(rows, cols, generator=g) * 0.05
    weight, scale = quantize_fp4(w) if fmt == "mxfp4" else quantize_fp8(w, 128, 128)
    module.weight = nn.Parameter(weight, requires_grad=False)
    module.scale = scale
    module.backend, module.activation_block = TorchLinear(), 128
    return module


def _alone(projections: dict[str, nn.Module], x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: module(x) for name, module in projections.items()}


def test_fused_projections_equal_each_projection_alone_and_share_one_weight():
    g = torch.Generator().manual_seed(0)
    projections = {"q": _float(48, 128, torch.float32, g), "kv": _float(16, 128, torch.float32, g),
                   "gate": _float(8, 128, torch.float32, g), "fp8": _quantized(128, 128, "fp8", g)}
    before = {name: m.weight.clone() for name, m in projections.items()}
    x = torch.randn(5, 128, generator=g)
    expected = _alone(projections, x)
    shared = SharedInput(projections)
    assert shared(x).keys() == expected.keys()  # unfused: each alone
    shared.fuse()
    assert len(shared.groups) == 2  # float and FP8 weights do not share a GEMM
    fused = shared(x)
    for name, module in projections.items():
        assert torch.equal(module.weight.view(torch.uint8), before[name].view(torch.uint8))  # the checkpoint's values, under the same names
        assert fused[name].shape == expected[name].shape
        assert torch.allclose(fused[name], expected[name], rtol=1e-5, atol=1e-5)
    storage = {projections[n].weight.untyped_storage().data_ptr() for n in ("q", "kv", "gate")}
    assert len(storage) == 1  # views of the fused weight: memory is not doubled
    assert fused["kv"].stride(0) == 48 + 16 + 8  # column slices of the one result


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_projections_fuse_with_their_scales(fmt):
    g = torch.Generator().manual_seed(1)
    projections = {"a": _quantized(256, 256, fmt, g), "b": _quantized(128, 256, fmt, g)}
    x = torch.randn(3, 256, generator=g)
    expected = _alone(projections, x)
    shared = SharedInput(projections)
    shared.fuse()
    assert len(shared.groups) == 1
    fused = shared(x)
    for name in projections:
        assert torch.allclose(fused[name], expected[name], rtol=1e-5, atol=1e-6)
        assert torch.allclose(projections[name](x), expected[name], rtol=1e-5, atol=1e-6)  # still usable alone


def test_a_projection_ending_inside_a_scale_tile_stays_alone():
    g = torch.Generator().manual_seed(2)
    projections = {"whole": _quantized(256, 256, "fp8", g), "partial": _quantized(200, 256, "fp8", g)}
    x = torch.randn(2, 256, generator=g)
    expected = _alone(projections, x)
    shared = SharedInput(projections)
    shared.fuse()
    assert [names for _, names, _ in shared.groups] == [["whole"], ["partial"]]
    for name, out in shared(x).items():
        assert torch.allclose(out, expected[name], rtol=1e-5, atol=1e-6)


def test_a_loaded_model_runs_its_attention_inputs_as_one_gemm(tiny_v4_checkpoint):
    from deepinfer import LLM

    llm = LLM(model=str(tiny_v4_checkpoint), dtype="float32", enforce_eager=True)
    layers = llm.engine.model.layers
    for layer in layers:
        (module, names, _), = layer.attn.inputs.groups
        assert names[:2] == ["q", "kv"]
        assert module.weight.shape[0] == sum(m.weight.shape[0] for m in layer.attn.inputs.projections.values())
        assert len(layer.ffn.shared_input.groups) == 1
    assert any("index.weights" in layer.attn.inputs.projections for layer in layers)  # a CSA layer's seven


def test_the_indexer_skips_scoring_when_every_candidate_fits(tiny_v4_checkpoint, monkeypatch):
    """With no more candidates than its top-k, a V4 indexer picks them all unscored: the same entries as scoring
    them, so the same tokens, and logprobs within the summation order's rounding."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v4.attention import Indexer

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 13, 21]]  # CSA ratio 4, top-4: up to 16 tokens every candidate fits
    skipped = []
    forward = Indexer.forward

    def spy(self, weights, qr, phases, keys, meta, backend):
        picked = forward(self, weights, qr, phases, keys, meta, backend)
        skipped.append(picked is meta.candidates)
        return picked

    monkeypatch.setattr(Indexer, "forward", spy)
    fast = LLM(model=str(tiny_v4_checkpoint), dtype="float32", enforce_eager=True).generate(prompts, params,
                                                                                         use_tqdm=False)
    assert any(skipped) and not all(skipped)  # the short context skips, the longer one scores

    def always_score(self, weights, qr, phases, keys, meta, backend):
        q = self.rotary.apply(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.dim), phases)
        return backend.indexer_topk(q, weights.float() * self.weight_scale, keys, meta.candidates, self.topk)

    monkeypatch.setattr(Indexer, "forward", always_score)
    scored = LLM(model=str(tiny_v4_checkpoint), dtype="float32", enforce_eager=True).generate(prompts, params,
                                                                                           use_tqdm=False)
    for ours, theirs in zip(fast, scored):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
