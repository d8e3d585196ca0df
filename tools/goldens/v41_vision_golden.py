"""Golden outputs of DeepSeek-V4.1's image preprocessing and vision encoder from NVIDIA NeMo AutoModel.

Runs in NeMo AutoModel's own environment (built as ``v41_golden.py``'s docstring says), on the tiny checkpoint
DeepInfer writes:

    python -m deepinfer.testing.make_tiny --arch v41 --vision /tmp/tiny_vision      # DeepInfer's environment
    . /tmp/nemo/bin/activate
    PYTHONPATH=. python tools/goldens/v41_vision_golden.py /tmp/tiny_vision tests/fixtures/v41_vision

It draws a few small images from a fixed seed (sizes and modes chosen so that every branch of the resize plan
runs: scaled up to ``min_pixels``, squeezed past ``max_wh_ratio``, scaled down to ``max_image_tokens``, one
token column), saves them as PNG next to the golden file, and records, from NeMo's own code reading those PNGs:

* ``golden.pt`` ``images``: per image its bf16 patches, NeMo's resize grid, the ViT output, the merged image
  tokens and the embeddings of the whole image span (NeMo's ``_image_embeddings``), all in fp32;
* ``golden.pt`` ``prompt``: one prompt holding every image, before and after NeMo's processor expands the
  placeholders (token ids and token types);
* ``golden.pt`` ``generation``: for a few prompts with one or two images (token ids with one placeholder per
  image, the images' files), the whole model's fp32 prefill logits and a greedy continuation, each new token
  computed by re-running the whole sequence with its images (NeMo has no KV cache).

The vision weights are the checkpoint's (bf16 projections, fp32 norms), renamed by NeMo's state-dict adapter.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41VisionConfig
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM, DeepseekV41Model
from nemo_automodel.components.models.deepseek_v41.processing import DeepseekV41Processor, _preprocess_image
from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import _native_key
from nemo_automodel.components.models.deepseek_v41.vision import (
    DeepseekV41VisionAligner,
    DeepseekV41VisionTransformer,
)

# name, width, height, mode (and what the tiny config makes of it)
IMAGES = (
    ("gradient_40x24", 40, 24, "RGB"),  # whole patches already: letterboxed onto itself
    ("small_13x7", 13, 7, "RGB"),  # scaled up to min_pixels
    ("dot_1x1", 1, 1, "RGB"),  # the smallest image there is
    ("gray_37x53", 37, 53, "L"),  # odd sizes, grayscale
    ("wide_150x20", 150, 20, "RGBA"),  # wider than max_wh_ratio: squeezed, alpha dropped
    ("palette_90x110", 90, 110, "P"),  # over the token budget: scaled down
    ("banner_120x32", 120, 32, "RGB"),  # within max_wh_ratio, over the budget
    ("tall_6x400", 6, 400, "RGB"),  # so tall that one token column is left
)
FIRST_TEXT_ID = 50
# whole-model prompts: raw ids, "IMG" where an image's placeholder goes, and the images' names (in order)
GENERATION_PROMPTS = (
    ([0, 5, 17, "IMG", 23, 99, 41], ("gradient_40x24",)),
    ([0, 7, "IMG", 60, 61, "IMG", 88, 12, 9], ("small_13x7", "banner_120x32")),
    ([0, "IMG", 33, 44, 55, 66], ("tall_6x400",)),
)
GREEDY_TOKENS = 8


def processed(raw_ids: list[int], image_paths: list[str], image_token_id: int, vision) -> dict:
    """NeMo's processor on fixed token ids (the tokenizer's part) and image files."""
    fake = SimpleNamespace(tokenizer=lambda texts, **_: {"input_ids": [list(raw_ids)]},
                           config=SimpleNamespace(image_token_id=image_token_id, vision_config=vision))
    return DeepseekV41Processor.__call__(fake, text=["(ids above)"], images=[image_paths], return_tensors="pt")


def whole_model(model_dir: Path, config: dict):
    """NeMo's DeepseekV41ForCausalLM in fp32 with the checkpoint's weights, through its own state-dict adapter."""
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # eager SwiGLU: torch.compile on CPU is not bitwise eager
    text = dict(config["text_config"], dtype="float32")
    top = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "quantization_config")}
    nemo_config = DeepseekV41Config(text_config=text, vision_config=config["vision_config"],
                                    **{**top, "dtype": "float32"})
    backend = BackendConfig(attn="eager", experts="torch", dispatcher="torch", linear="torch", rms_norm="torch_fp32",
                            rope_fusion=False, enable_hf_state_dict_adapter=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    model = DeepseekV41ForCausalLM(nemo_config, backend=backend, tokenizer=tokenizer).float()
    native = model.state_dict_adapter.from_hf(load_file(str(model_dir / "model.safetensors")))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in native.items()}, strict=False)
    missing = [k for k in missing if "engram_hash" not in k]
    if missing or unexpected:
        sys.exit(f"reference reload mismatch: missing {missing} unexpected {unexpected}")
    return model.eval()


def generation_goldens(model_dir: Path, config: dict, out: Path, vision) -> list[dict]:
    model = whole_model(model_dir, config)
    image_token_id = int(config["image_token_id"])
    goldens = []
    for template, names in GENERATION_PROMPTS:
        raw = [image_token_id if t == "IMG" else t for t in template]
        batch = processed(raw, [str(out / f"{name}.png") for name in names], image_token_id, vision)
        ids, types = batch["input_ids"], batch["vision_token_types"]
        images = {"pixel_values": batch["pixel_values"], "image_grid_hws": batch["image_grid_hws"]}
        with torch.no_grad():
            logits = model(ids, vision_token_types=types, **images).logits[0].float()
            sequence = ids[0].tolist()
            for _ in range(GREEDY_TOKENS):
                grown = torch.tensor([sequence])
                grown_types = torch.cat([types, torch.full((1, len(sequence) - types.shape[1]), -1)], dim=1)
                sequence.append(int(model(grown, vision_token_types=grown_types, **images).logits[0, -1].argmax()))
        goldens.append({"raw_ids": raw, "images": [f"{name}.png" for name in names], "input_ids": ids[0].tolist(),
                        "logits": logits, "greedy": sequence[ids.shape[1]:]})
        print(f"{names}: {ids.shape[1]} tokens, greedy {goldens[-1]['greedy']}")
    return goldens


def draw(width: int, height: int, mode: str, rng: np.random.Generator) -> Image.Image:
    """Gradients in each channel plus noise: smooth and sharp content for the resampling to get wrong."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                     255 * (x + y) / max(width + height - 2, 1), 255 - 128 * x / max(width - 1, 1)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    if mode == "L":
        return Image.fromarray(pixels[..., 0], "L")
    if mode == "RGBA":
        return Image.fromarray(pixels, "RGBA")
    rgb = Image.fromarray(np.ascontiguousarray(pixels[..., :3]), "RGB")
    return rgb.quantize(16) if mode == "P" else rgb


def vision_modules(model_dir: Path, config: dict):
    """NeMo's tower and aligner in fp32, holding the checkpoint's vision weights."""
    vision = DeepseekV41VisionConfig(**config["vision_config"])
    top = SimpleNamespace(vision_config=vision, text_config=SimpleNamespace(hidden_size=config["text_config"]
                                                                            ["hidden_size"]), dtype="float32")
    tower, aligner = DeepseekV41VisionTransformer(top).float(), DeepseekV41VisionAligner(top).float()
    native = {}
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            key = _native_key(name)
            if key.startswith(("model.vision.", "model.aligner.", "model.image_")):
                native[key.removeprefix("model.")] = f.get_tensor(name).float()
    tower.load_state_dict({k.removeprefix("vision."): v for k, v in native.items() if k.startswith("vision.")})
    aligner.load_state_dict({k.removeprefix("aligner."): v for k, v in native.items() if k.startswith("aligner.")})
    delimiters = {k: torch.nn.Parameter(v) for k, v in native.items() if k.startswith("image_")}
    return vision, tower.eval(), aligner.eval(), delimiters


def main(model_dir: str, out_dir: str) -> None:
    model_dir, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    vision, tower, aligner, delimiters = vision_modules(model_dir, config)
    image_token_id = int(config["image_token_id"])

    rng = np.random.default_rng(0)
    paths = []
    for name, width, height, mode in IMAGES:
        paths.append(out / f"{name}.png")
        draw(width, height, mode, rng).save(paths[-1])

    # NeMo's processor expands one prompt holding every image; the tokenizer's part is fixed ids here.
    raw_ids = [0, 3] + [t for i in range(len(paths)) for t in (FIRST_TEXT_ID + i, image_token_id)] + [4]
    batch = processed(raw_ids, [str(p) for p in paths], image_token_id, vision)
    embed = torch.nn.Embedding(int(config["text_config"]["vocab_size"]), int(config["text_config"]["hidden_size"]))
    model = SimpleNamespace(vision=tower, aligner=aligner, embed_tokens=embed, vision_config=vision,
                            image_token_id=image_token_id, **delimiters)
    with torch.no_grad():
        embedded = DeepseekV41Model._image_embeddings(model, batch["input_ids"], batch["pixel_values"],
                                                      batch["image_grid_hws"], batch["vision_token_types"])[0]
    types = batch["vision_token_types"][0]
    starts = (types == 0).nonzero().flatten().tolist()
    ends = (types == 3).nonzero().flatten().tolist()

    images = []
    for (name, *_), path, start, end in zip(IMAGES, paths, starts, ends):
        patches, grid = _preprocess_image(str(path), vision)
        with torch.no_grad():
            states = tower(patches.float(), grid.vit_height, grid.vit_width)
            tokens = aligner(states, grid.vit_height, grid.vit_width)
        images.append({
            "file": path.name, "patches": patches,
            "grid": (grid.height, grid.width, grid.vit_height, grid.vit_width, grid.llm_height, grid.llm_width),
            "num_tokens": end + 1 - start, "vit_states": states, "image_tokens": tokens,
            "span_embeddings": embedded[start:end + 1].clone(),
        })
        print(f"{name}: grid {images[-1]['grid']}, {images[-1]['num_tokens']} tokens")
    prompt = {"raw_ids": raw_ids, "input_ids": batch["input_ids"][0].tolist(), "token_types": types.tolist(),
              "image_token_id": image_token_id}
    generation = generation_goldens(model_dir, config, out, vision)
    torch.save({"vision_config": config["vision_config"], "images": images, "prompt": prompt,
                "generation": generation}, out / "golden.pt")
    print(f"wrote {out / 'golden.pt'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
