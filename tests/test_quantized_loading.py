"""Quantized checkpoints as shipped: weights kept in FP8/MXFP4, the linear hook, load errors, dummy weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.runtime.linear import Linear
from deepinfer.plugins import hookimpl
from deepinfer.plugins.builtin.torch_linear import TorchLinear
from deepinfer.plugins.manager import registered

FIXTURE = Path(__file__).parent / "fixtures" / "v41_tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [[0, 17, 99, 3, 250, 41, 7, 300, 12, 5]]


@pytest.fixture(scope="module")
def quantized():
    return LLM(str(FIXTURE), dtype="float32")


def _tokens(llm, prompts=PROMPT):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_weights_stay_in_the_checkpoint_format(quantized):
    model = quantized.engine.model
    attn = model.layers[2].attn
    assert attn.wq_a.weight.dtype == torch.float8_e4m3fn and attn.wq_a.scale.dtype == torch.float8_e8m0fnu
    assert attn.wq_a.scale.shape == (-(-attn.wq_a.weight.shape[0] // 32), -(-attn.wq_a.weight.shape[1] // 32))
    experts = model.layers[2].ffn.experts
    assert experts.w1.weight.dtype == torch.int8 and experts.w1.weight.shape == (8, 32, 32)  # [E, I, H/2]
    assert experts.w1.scale.shape == (8, 32, 2)
    # kept as shipped too, though DeepSeek's converter dequantizes it: LinearBackend.grouped_linear multiplies it
    assert attn.wo_a.weight.dtype == torch.float8_e4m3fn and attn.wo_a.scale is not None
    assert model.layers[0].attn.attn_sink.dtype == torch.float32
    # every quantized byte of the checkpoint is held as is, except those dequantized on purpose
    low_precision = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
    shipped = sum(t.numel() * t.element_size() for name, t in load_file(FIXTURE / "model.safetensors").items()
                  if t.dtype in low_precision and not name.startswith(("mtp.", "layers.1.engram.embed",
                                                                       "layers.7.engram.embed")))
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t.dtype in low_precision)
    assert held == shipped > 0


def test_the_v41_head_stays_as_shipped_and_logits_are_fp32():
    """bf16 in a bf16 engine (no fp32 copy of the head); the backend's ``logits`` computes in fp32 from it."""
    engine = LLM(str(FIXTURE), dtype="bfloat16").engine
    head = engine.model.head.weight
    assert head.dtype == torch.bfloat16
    hidden = torch.randn(3, head.shape[1])
    logits = engine.model.project_vocab(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ head.float().T, rtol=1e-6, atol=1e-6)


def test_quantization_none_dequantizes_when_loading(quantized):
    plain = LLM(str(FIXTURE), dtype="float32", quantization="none")
    attn = plain.engine.model.layers[2].attn
    assert attn.wq_a.weight.dtype == torch.float32 and attn.wq_a.scale is None
    assert plain.engine.model.layers[2].ffn.experts.w1.weight.shape == (8, 32, 64)
    assert _weight_bytes(plain.engine.model) > 2 * _weight_bytes(quantized.engine.model)


class CountingLinear(TorchLinear):
    name = "counting-linear"
    calls = 0
    logits_calls = 0

    def linear(self, *args):
        CountingLinear.calls += 1
        return super().linear(*args)

    def logits(self, *args):
        CountingLinear.logits_calls += 1
        return super().logits(*args)


class LinearPlugin:
    @hookimpl
    def deepinfer_linear_backend(self, config, device):
        return CountingLinear()


def test_hook_deepinfer_linear_backend(quantized, caplog):
    expected = _tokens(quantized)
    with registered(LinearPlugin(), "counting"):
        assert _tokens(LLM(str(FIXTURE), dtype="float32")) == expected
    assert CountingLinear.calls > 0
    assert CountingLinear.logits_calls > 0  # V4.1's vocabulary projection too
    assert "linear backend: counting-linear (plugin counting)" in caplog.text
    modules = [m for m in quantized.engine.model.modules() if isinstance(m, Linear)]
    assert modules and all(type(m.backend) is TorchLinear for m in modules if m.scale is not None)


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / "m"
    shutil.copytree(FIXTURE, target)
    return target


def test_truncated_shard_is_named(tmp_path):
    model = _copy(tmp_path)
    shard = model / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated: its header describes \d+ bytes"):
        LLM(str(model), dtype="float32")


def test_missing_scale_is_named_with_its_file(tmp_path):
    model = _copy(tmp_path)
    tensors = load_file(model / "model.safetensors")
    del tensors["layers.3.attn.wq_b.scale"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.3\.attn\.wq_b\.weight \(in model\.safetensors\): a "
                                         r"torch\.float8_e4m3fn weight needs its scale layers\.3\.attn\.wq_b\.scale"):
        LLM(str(model), dtype="float32")


def test_wrong_block_size_is_named(tmp_path):
    model = _copy(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_a\.scale \(in model\.safetensors\): shape \(1, 2\) "
                                         r"does not fit 16x16 blocks of its \(32, 64\) weight, which need \(2, 4\)"):
        LLM(str(model), dtype="float32")
    # dequantizing when loading takes any power-of-two tiling, so the same files load with quantization="none"
    assert LLM(str(model), dtype="float32", quantization="none").engine.model is not None


def test_dummy_weights_come_in_the_released_formats():
    first = LLM(str(FIXTURE), dtype="float32", load_format="dummy", seed=3)
    model = first.engine.model
    assert model.layers[2].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert model.layers[2].ffn.experts.w2.weight.dtype == torch.int8
    assert model.layers[1].engram.table.dtype == torch.float8_e4m3fn
    tokens = _tokens(first)
    assert len(tokens[0]) == 8
    assert _tokens(LLM(str(FIXTURE), dtype="float32", load_format="dummy", seed=3)) == tokens
    logits = first.engine.model.compute_logits(torch.zeros(1, model.config.hidden_size))
    assert torch.isfinite(logits).all()


def test_bad_engine_arguments_are_named():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(FIXTURE), quantization="fp4")
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(str(FIXTURE), load_format="pt")


@pytest.fixture(scope="module")
def quantized_v4(tiny_v4_checkpoint, tmp_path_factory):
    from deepinfer.loading.convert import convert_checkpoint

    return convert_checkpoint(tiny_v4_checkpoint, tmp_path_factory.mktemp("v4") / "fp8", progress=False)


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_kept_weights_are_multiplied_exactly(which, quantized_v4, monkeypatch):
    """Without activation rounding the kept-quantized engine computes what the dequantized one does, so the
    only difference left between them is FP8 activation rounding (bounded per GEMM in test_quantization)."""
    import deepinfer.runtime.quantization as quantization
    from deepinfer.testing.probes import prefill_logits

    model_dir = str(quantized_v4 if which == "v4" else FIXTURE)
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    dequantized = prefill_logits(LLM(model_dir, dtype="float32", quantization="none"), prompt)
    kept = LLM(model_dir, dtype="float32")
    rounded = prefill_logits(kept, prompt)
    monkeypatch.setattr(quantization, "round_fp8", lambda x, block: x)
    exact = prefill_logits(kept, prompt)
    assert float((exact - dequantized).norm() / dequantized.norm()) < 1e-5
    assert not torch.allclose(rounded, dequantized, rtol=1e-3)  # the activations really are rounded by default
    if which == "v4":
        layer = kept.engine.model.layers[1]
        assert layer.attn.wq_b.scale.shape == (1, 1)  # one 128x128 block covers the tiny matrix
        assert layer.ffn.experts.w2.weight.dtype == torch.int8
