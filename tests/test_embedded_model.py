"""The trained model shipped inside the package (``deepinfer-tiny-v4.1``): format, tokenizer, what it learned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer import LLM
from deepinfer.loading.model_source import EMBEDDED_MODEL, EMBEDDED_MODEL_DIR
from deepinfer.testing.probes import prefill_logits

# DeepInfer's own source: Python the model never saw (it was trained on the standard library only).
UNSEEN_CODE = Path(__file__).resolve().parents[1] / "deepinfer" / "engine" / "scheduler.py"


@pytest.fixture(scope="module")
def embedded():
    return LLM(EMBEDDED_MODEL, dtype="float32")


def _loss(llm, ids: list[int]) -> float:
    logprobs = prefill_logits(llm, ids[:-1]).float().log_softmax(-1)
    return float(-logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean())


def test_shipped_in_the_released_v41_format_and_small():
    files = {p.name: p.stat().st_size for p in EMBEDDED_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files.keys()
    assert sum(files.values()) <= 20 * 2**20
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41"


def test_every_v41_layer_kind_is_present(embedded):
    c = embedded.engine.model_config
    assert {0, 1, 2} <= set(c.compress_ratios)  # window-only, CSA2 ratio 1 and 2
    assert len(c.kv_source_layer_ids) < sum(r > 0 for r in c.compress_ratios)  # some layers reuse a KV source
    assert c.candidate_source_layer_id in c.kv_source_layer_ids and any(c.uses_candidates(i) for i in range(c.num_layers))
    assert c.engram_layer_ids and c.hc_mult == 4 and c.n_routed_experts > 1
    assert c.compress_ratios[-1] == 0  # a trailing window-only decoder layer
    with safe_open(str(EMBEDDED_MODEL_DIR / "model.safetensors"), "pt") as f:
        stages = {name.split(".")[1] for name in f.keys() if name.startswith("mtp.")}
    assert stages == {"0", "1", "2"} and c.num_nextn_predict_layers == 3  # DSpark draft stages (tests/test_dspark.py)
    attn = embedded.engine.model.layers[2].attn
    assert attn.wq_a.weight.dtype == torch.float8_e4m3fn  # kept as shipped


def test_tokenizer_has_deepseeks_special_tokens_and_chat_encoding(embedded):
    tokenizer = embedded.engine.tokenizer
    ids = tokenizer.convert_tokens_to_ids(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                                           "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"])
    assert ids == [0, 1, 2, 3, 4, 5, 6]
    assert tokenizer.encode("x")[0] == 0  # BOS prepended
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


def test_it_learned_python(embedded):
    ids = [0] + embedded.engine.tokenizer.encode(UNSEEN_CODE.read_text(), add_special_tokens=False)[:511]
    loss = _loss(embedded, ids)
    # a uniform guess costs ln(3072) = 8.0 nats, the training corpus' unigram distribution 6.5; measured 4.77
    assert loss < 5.5, f"loss {loss:.2f} on unseen Python"
    # and the FP8/MXFP4 weights with FP8 activations cost little against the dequantized model (measured +0.3%)
    dequantized = _loss(LLM(EMBEDDED_MODEL, dtype="float32", quantization="none"), ids)
    assert abs(loss - dequantized) < 0.02 * dequantized
