"""``deepinfer bench vision``: DeepSeek-V4.1's vision encoder in images/s, and the time to first token of prompts
with 1 and 4 images.

One synthetic image of ``--image-size`` (random pixels, the processor's resizing applied) is encoded
``--num-iters`` times by the engine's encoder with the selected vision-attention backend, then with the reference
attention (``vision_attention``: the same ``scaled_dot_product_attention`` call as NeMo AutoModel's eager tower,
torch picking its kernel) in the same process: the peer. Then prompts of a few text tokens around N distinct new
images (never in the encoder cache) generate one token each, ``--num-iters`` times: the time to first token,
encoding and prefill included.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from deepinfer.bench.throughput import _add_common, build_llm


def _random_images(count: int, size: tuple[int, int], seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_attention(encoder, attend) -> None:
    for block in encoder.vision.blocks:
        block.attn.attend = attend


def _encoder_seconds(encoder, patches, grid, attentions: dict, iters: int, device) -> dict[str, float]:
    """Median seconds of one image through the encoder with each of ``attentions`` (name -> attend), the runs
    alternating (after a warm-up call of each) so that drift in clocks or contention falls on both alike. The
    encoder's own attention is put back afterwards."""
    selected = encoder.vision.blocks[0].attn.attend
    try:
        return _alternating_medians(encoder, patches, grid, attentions, iters, device)
    finally:
        _set_attention(encoder, selected)


def _alternating_medians(encoder, patches, grid, attentions: dict, iters: int, device) -> dict[str, float]:
    times = {name: [] for name in attentions}
    for i in range(iters + 1):
        for name, attend in attentions.items():
            _set_attention(encoder, attend)
            _sync(device)
            start = time.perf_counter()
            encoder(patches, grid.rows, grid.cols)
            _sync(device)
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(args, vocab: int) -> dict:
    from deepinfer import SamplingParams
    from deepinfer.models.deepseek_v41.image_processing import preprocess_image
    from deepinfer.models.deepseek_v41.vision import vision_attention

    if args.compare_hf:
        raise SystemExit("bench vision's peer is the reference attention in the same process: --compare-hf does "
                         "not apply")
    llm = build_llm(args, max_num_seqs=1)
    engine = llm.engine
    if engine.encoder_cache is None:
        raise SystemExit(f"{args.model} has no vision tower (config.json vision_config)")
    encoder, device = engine.encoder_cache.encoder, engine.device
    config = engine.model_config.vision_config
    image = preprocess_image(_random_images(1, args.image_size, args.seed)[0], config)
    patches, grid = image.patches.to(device), image.grid
    selected = encoder.vision.blocks[0].attn.attend
    with torch.inference_mode():
        seconds = _encoder_seconds(encoder, patches, grid, {"selected": selected, "reference": vision_attention},
                                   args.num_iters, device)
    ours, reference = seconds["selected"], seconds["reference"]
    results = {"vision_attention": getattr(getattr(selected, "__self__", None), "name", "torch-reference"),
               "image": {"size": list(args.image_size), "patches": grid.rows * grid.cols,
                         "image_tokens": grid.num_tokens},
               "encoder_images_per_second": 1 / ours, "reference_attention_images_per_second": 1 / reference,
               "speedup": reference / ours, "ttft_seconds": {}}
    image_token = engine.model_config.image_token_id
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for count in args.images_per_prompt:
        prompt_ids = [5, 6, 7] + [image_token, 8] * count + [9, 10]
        times = []
        for i in range(args.num_iters + 1):  # the first is a warm-up
            images = _random_images(count, args.image_size, args.seed + 1 + i * count)
            start = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": images}}, params,
                         use_tqdm=False)
            times.append(time.perf_counter() - start)
        results["ttft_seconds"][f"{count} image{'s' if count > 1 else ''}"] = statistics.median(times[1:])
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--image-size", type=int, nargs=2, default=[1024, 768], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--images-per-prompt", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-iters", type=int, default=5)
    parser.set_defaults(run=run)
