"""Write a tiny random DeepSeek-V4 checkpoint: ``python -m deepinfer.testing.make_tiny OUT_DIR``.

The weights are random, so generated text is noise; the checkpoint exercises the whole
engine (config, tokenizer, safetensors, every attention kind) in seconds on a CPU.
"""

from __future__ import annotations

import argparse

from deepinfer.testing.tiny_v4 import build_tiny_v4


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.testing.make_tiny", description="Write a tiny random DeepSeek-V4 checkpoint.")
    parser.add_argument("out_dir", help="directory to write config.json, model.safetensors and the tokenizer into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    args = parser.parse_args(argv)
    print(build_tiny_v4(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
