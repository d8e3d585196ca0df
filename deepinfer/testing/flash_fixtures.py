"""Config-only fixtures of full-size shapes, for ``deepinfer bench ... --load-format dummy`` (no weight files).

``flash4L`` is DeepSeek-V4-Flash's first four layers (sliding, sliding, CSA, HCA; the first three hash-routed)
at the release's dimensions, bf16 weights throughout. HF transformers' ``DeepseekV4Config`` defaults are
V4-Flash's values, so the fixture only names what it changes. The tokenizer is the small test one: benchmarks
feed token ids, and only decode of the outputs goes through it.

    python -m deepinfer.testing.flash_fixtures flash4L /tmp/flash4L
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer

FIXTURES = {
    "flash4L": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        num_hash_layers=3,
        num_nextn_predict_layers=0,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    ),
}


def write_fixture(name: str, out_dir: str | Path, **overrides) -> Path:
    """config.json (+ tokenizer) of fixture ``name`` in ``out_dir``; ``overrides`` shrink it for tests."""
    from transformers import DeepseekV4Config

    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; known: {sorted(FIXTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = DeepseekV4Config(**{**FIXTURES[name], **overrides})
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    build_tiny_tokenizer(out, vocab_size=4096)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(FIXTURES))
    parser.add_argument("out_dir")
    args = parser.parse_args()
    print(write_fixture(args.name, args.out_dir))
