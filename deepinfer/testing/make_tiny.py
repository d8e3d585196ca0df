"""Write a tiny random checkpoint: ``python -m deepinfer.testing.make_tiny OUT_DIR [--arch v41|v4]``.

The weights are random, so generated text is noise; the checkpoint exercises the whole engine (config, tokenizer,
safetensors in the released formats, every attention kind) in seconds on a CPU. ``v41`` (the default) is
DeepSeek-V4.1; ``v4`` is DeepSeek-V4, written by HF transformers' ``DeepseekV4ForCausalLM``. ``--vision`` gives
the V4.1 checkpoint a tiny vision tower (``vision.*``, ``aligner.*``, ``image_*`` in the released layout).
"""

from __future__ import annotations

import argparse

from deepinfer.testing.tiny_v4 import build_tiny_v4
from deepinfer.testing.tiny_v41 import build_tiny_v41

BUILDERS = {"v41": build_tiny_v41, "v4": build_tiny_v4}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.testing.make_tiny",
                                     description="Write a tiny random DeepSeek checkpoint.")
    parser.add_argument("out_dir", help="directory to write config.json, model.safetensors and the tokenizer into")
    parser.add_argument("--arch", choices=sorted(BUILDERS), default="v41", help="architecture (default v41)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--vision", action="store_true", help="add a tiny vision tower (v41 only)")
    parser.add_argument("--dspark", action="store_true", help="add random DSpark draft stages (v41 only)")
    args = parser.parse_args(argv)
    if args.vision and args.arch != "v41":
        parser.error("--vision needs --arch v41 (DeepSeek-V4 has no vision tower)")
    if args.dspark and args.arch != "v41":
        parser.error("--dspark needs --arch v41 (DeepSeek-V4's draft is a classic MTP layer)")
    options = {name: True for name in ("vision", "dspark") if getattr(args, name)}
    print(BUILDERS[args.arch](args.out_dir, seed=args.seed, **options))


if __name__ == "__main__":
    main()
