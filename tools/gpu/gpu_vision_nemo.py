"""NeMo AutoModel's eager DeepSeek-V4.1 vision tower and aligner against the engine's encoder: same device, same
weights, same image, one process (issue 43's bench peer).

    python tools/gpu/gpu_vision_nemo.py /tmp/v41flash8Lvision [--image-size 1024 768] [--num-iters 10]

NeMo AutoModel runs from a wheel installed without its dependencies (its vision modules import none of them):
``pip install --no-deps --target /tmp/nemo nemo_automodel-0.7.0-py3-none-any.whl`` and ``PYTHONPATH=/tmp/nemo``.
The engine loads the checkpoint (``--load-format dummy`` for a config-only fixture); NeMo's modules are built from
the same ``vision_config`` in bf16 and take the engine encoder's parameters (their names are the release's on
both sides). Both preprocessors read the same random image: their patches must be equal, and the two encoders'
image tokens must agree to bf16 rounding, before anything is timed. Each encoder then runs ``--num-iters`` times,
alternating (median, the device synchronized around each call). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from deepinfer import LLM
from deepinfer.bench.vision import _sync
from deepinfer.models.deepseek_v41.image_processing import preprocess_image


def nemo_encoder(vision_config: dict, text_hidden: int, ours, device: torch.device):
    """NeMo's tower and aligner holding ``ours``' (the engine's ``VisionEncoder``) weights, in bf16 on ``device``."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig
    from nemo_automodel.components.models.deepseek_v41.vision import (DeepseekV41VisionAligner,
                                                                       DeepseekV41VisionTransformer)

    vision = DeepseekV41VisionConfig(**vision_config)
    top = SimpleNamespace(vision_config=vision, text_config=SimpleNamespace(hidden_size=text_hidden), dtype="bfloat16")
    tower, aligner = DeepseekV41VisionTransformer(top), DeepseekV41VisionAligner(top)
    tower.load_state_dict(ours.vision.state_dict())
    aligner.load_state_dict(ours.aligner.state_dict())
    tower, aligner = tower.to(device).eval(), aligner.to(device).eval()
    return vision, lambda patches, rows, cols: aligner(tower(patches, rows, cols), rows, cols)


def median_seconds(encoders: dict, patches: torch.Tensor, rows: int, cols: int, iters: int, device) -> dict:
    times = {name: [] for name in encoders}
    for i in range(iters + 1):  # the first round warms up
        for name, encode in encoders.items():
            _sync(device)
            start = time.perf_counter()
            encode(patches, rows, cols)
            _sync(device)
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--image-size", type=int, nargs=2, default=[1024, 768], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--num-iters", type=int, default=10)
    args = parser.parse_args()
    from nemo_automodel.components.models.deepseek_v41.processing import _preprocess_image

    llm = LLM(args.model, load_format=args.load_format, dtype="bfloat16", max_num_seqs=1)
    engine = llm.engine
    encoder, device = engine.encoder_cache.encoder, engine.device
    config = json.load(open(f"{args.model}/config.json"))
    text_hidden = (config.get("text_config") or config)["hidden_size"]
    vision, nemo = nemo_encoder(config["vision_config"], text_hidden, encoder, device)

    pixels = np.random.default_rng(0).integers(0, 256, (args.image_size[1], args.image_size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    ours_image = preprocess_image(image, engine.model_config.vision_config)
    nemo_patches, grid = _preprocess_image(image, vision)
    if not torch.equal(ours_image.patches, nemo_patches):
        raise SystemExit("the two preprocessors' patches differ")
    rows, cols = ours_image.grid.rows, ours_image.grid.cols
    patches = ours_image.patches.to(device)
    with torch.inference_mode():
        got, want = encoder(patches, rows, cols).float(), nemo(patches, rows, cols).float()
        error = float((got - want).norm() / want.norm())
        if not error < 2e-2:
            raise SystemExit(f"the encoders disagree: relative error {error:.3g}")
        seconds = median_seconds({"deepinfer": encoder, "nemo": nemo}, patches, rows, cols, args.num_iters, device)
    attention = getattr(getattr(encoder.vision.blocks[0].attn.attend, "__self__", None), "name", "torch-reference")
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "image": {"size": args.image_size, "patches": rows * cols, "image_tokens": got.shape[0]},
                      "vision_attention": attention, "relative_error_vs_nemo": error,
                      "deepinfer_images_per_second": 1 / seconds["deepinfer"],
                      "nemo_images_per_second": 1 / seconds["nemo"], "speedup": seconds["nemo"] / seconds["deepinfer"]}))


if __name__ == "__main__":
    main()
