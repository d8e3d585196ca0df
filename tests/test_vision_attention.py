"""The vision tower's attention hook (``deepinfer_vision_attention_backend``): the reference plugin serves it, the
engine's tower attends through whichever backend is selected, and the NVIDIA plugin's kernels (GPU only) match the
reference on fresh random inputs at V4.1-Flash's head shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pluggy
import pytest
import torch

pytest.importorskip("PIL")

from deepinfer import LLM, SamplingParams
from deepinfer.chat_encoding import IMAGE_PLACEHOLDER
from deepinfer.models.deepseek_v41.vision import vision_attention
from deepinfer.plugins import hookimpl, hookspecs
from deepinfer.plugins.builtin import torch_vision_attention
from deepinfer.plugins.builtin.torch_vision_attention import TorchVisionAttention
from deepinfer.plugins.manager import registered

FIXTURE = Path(__file__).parent / "fixtures" / "v41_vision"
CUDA = torch.cuda.is_available()


def _qkv(patches: int, heads: int, dim: int, dtype=torch.float32, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(patches, heads, dim, generator=g).to(device, dtype) for _ in range(3)]


def test_hook_deepinfer_vision_attention_backend():
    pm = pluggy.PluginManager("deepinfer")
    pm.add_hookspecs(hookspecs)
    pm.register(torch_vision_attention)
    backend = pm.hook.deepinfer_vision_attention_backend(config=None, device=torch.device("cpu"))
    assert isinstance(backend, TorchVisionAttention) and backend.name == "torch-reference"
    q, k, v = _qkv(37, 2, 16)
    out = backend.attention(q, k, v)
    assert out.shape == (37, 32)
    weights = torch.softmax(torch.einsum("phd,khd->hpk", q, k) * 16**-0.5, dim=-1)
    assert torch.allclose(out, torch.einsum("hpk,khd->phd", weights, v).flatten(1), atol=1e-5)


class CountingPlugin:
    """Serves the reference's attention and counts the tower's calls."""

    def __init__(self):
        self.calls = 0

    @hookimpl
    def deepinfer_vision_attention_backend(self, config, device):
        plugin = self

        class Counting:
            name = "counting"

            def attention(self, q, k, v):
                plugin.calls += 1
                return vision_attention(q, k, v)

        return Counting()


def test_the_engines_tower_attends_through_the_selected_backend(tiny_vision_checkpoint):
    images = [str(FIXTURE / "gray_37x53.png"), str(FIXTURE / "small_13x7.png")]
    prompt = {"prompt": f"look: {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER} what are they?",
              "multi_modal_data": {"image": images}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    model = str(tiny_vision_checkpoint)
    expected = LLM(model, dtype="float32", quantization="none").generate(prompt, params, use_tqdm=False)
    counting = CountingPlugin()
    with registered(counting, "counting"):
        llm = LLM(model, dtype="float32", quantization="none")
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert counting.calls == 2 * llm.engine.model_config.vision_config.num_layers  # each image once, every layer


@pytest.mark.skipif(not CUDA, reason="the NVIDIA plugin's vision attention needs a GPU")
@pytest.mark.parametrize("patches", [1, 37, 1000, 9216])
def test_nvidia_vision_attention_matches_the_reference(patches):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends" / "nvidia"))
    from deepinfer_nvidia import plugin

    backend = plugin.deepinfer_vision_attention_backend(config=None, device=torch.device("cuda"))
    assert plugin.deepinfer_vision_attention_backend(config=None, device=torch.device("cpu")) is None
    q, k, v = _qkv(patches, 16, 64, torch.bfloat16, "cuda", seed=patches)  # V4.1-Flash: 16 heads of 64
    out = backend.attention(q, k, v)
    reference = vision_attention(q.float(), k.float(), v.float())
    assert out.dtype == torch.bfloat16 and out.shape == (patches, 1024)
    assert (out.float() - reference).abs().max() <= 2**-7 * reference.abs().max() + 1e-3
    assert len(backend.chosen) == 1
    assert torch.equal(backend.attention(q, k, v), out)  # the chosen kernel repeats itself


def test_bench_vision_times_the_encoder_against_the_reference_and_ttft(tiny_vision_checkpoint, tmp_path):
    import json

    from deepinfer.cli import main

    out = tmp_path / "vision.json"
    main(["bench", "vision", "--model", str(tiny_vision_checkpoint), "--image-size", "40", "24", "--num-iters", "1",
          "--images-per-prompt", "1", "2", "--output-json", str(out)])
    result = json.loads(out.read_text())
    assert result["vision_attention"] == "torch-reference"
    assert result["image"] == {"size": [40, 24], "patches": 60, "image_tokens": 20}
    assert result["encoder_images_per_second"] > 0 and result["reference_attention_images_per_second"] > 0
    assert set(result["ttft_seconds"]) == {"1 image", "2 images"} and min(result["ttft_seconds"].values()) > 0


def test_bench_vision_puts_the_selected_attention_back(tiny_vision_checkpoint):
    """The encoder's timing swaps the reference attention in; the TTFT runs after it must use the selected one."""
    from deepinfer.bench.vision import _encoder_seconds
    from deepinfer.models.deepseek_v41.image_processing import preprocess_image
    from PIL import Image

    llm = LLM(str(tiny_vision_checkpoint), dtype="float32", quantization="none")
    encoder = llm.engine.encoder_cache.encoder
    selected = encoder.vision.blocks[0].attn.attend
    image = preprocess_image(Image.new("RGB", (40, 24)), llm.engine.model_config.vision_config)
    with torch.inference_mode():
        seconds = _encoder_seconds(encoder, image.patches.to(llm.engine.device), image.grid,
                                   {"selected": selected, "reference": vision_attention}, 1, llm.engine.device)
    assert set(seconds) == {"selected", "reference"}
    assert all(block.attn.attend == selected for block in encoder.vision.blocks)
