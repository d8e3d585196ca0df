"""Config-only fixtures of full-size shapes, for ``deepinfer bench ... --load-format dummy`` (no weight files).

- ``flash4L``: DeepSeek-V4-Flash's first four layers (sliding, sliding, CSA, HCA; the first three hash-routed) at
  the release's dimensions, bf16 weights throughout. HF transformers' ``DeepseekV4Config`` defaults are V4-Flash's
  values, so the fixture only names what it changes.
- ``flash4Lfp8``: ``flash4L`` in V4-Flash-Base's formats: every projection and routed expert FP8 e4m3 in 128 x 128
  tiles (``expert_dtype`` "fp8"), the rest bf16.
- ``v41flash8L``: DeepSeek-V4.1-Flash's first eight layers (sliding, sliding with Engram, then six ratio-2 CSA2
  layers reading layer 2's KV and index source) at the release's dimensions and formats: FP8 32x32 projections,
  MXFP4 experts (384, top-6). Engram keeps the release's heads and widths, but its hash vocabulary is cut from 16M
  to 100k, so its table is 2.5M rows (640 MB) instead of 384M.

- ``v41flash``: DeepSeek-V4.1-Flash's 40 layers at the release's dimensions and formats (the full-scale run):
  ratio 0 for layers 0-1, ratio-2 CSA2 for 2-19, ratio-1 for 20-39; KV sources 2, 8, 14, 20; index sources 2, 8, 14,
  20, 24, 28, 32, 36, with layer 20 publishing candidate blocks; Engram at layers 1 and 14. Engram's hash vocabulary
  is cut as in ``v41flash8L``: dummy weights are drawn in each process's memory, and the release's two tables (203
  GB, which ``DEEPINFER_ENGRAM_TABLES=auto`` keeps memory-mapped on the host) would not fit there once per rank.
  No DSpark stages: their block size and Markov rank are not public.

The tokenizer is the small test one: benchmarks feed token ids, and only decoding the outputs goes through it.

    python -m deepinfer.testing.flash_fixtures flash4L /tmp/flash4L
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer

TOKENIZER_VOCAB = 4096

FLASH4L = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
    num_hash_layers=3,
    num_nextn_predict_layers=0,
    max_position_embeddings=65536,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
)

FLASH4L_FP8 = dict(
    **FLASH4L,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    expert_dtype="fp8",
)

V41_FLASH_8L = dict(
    vocab_size=129280,
    hidden_size=5120,
    num_hidden_layers=8,
    num_attention_heads=64,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1280,
    o_lora_rank=1024,
    o_groups=8,
    n_routed_experts=384,
    num_experts_per_tok=6,
    n_shared_experts=1,
    moe_intermediate_size=2304,
    scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5,
    rms_norm_eps=1e-20,
    sliding_window=128,
    hc_mult=4,
    compress_ratios=[0, 0, 2, 2, 2, 2, 2, 2],
    kv_source_layer_ids=[2],
    index_source_layer_ids=[2],
    index_n_heads=32,
    index_head_dim=128,
    index_topk=512,
    engram_layer_ids=[1],
    engram_num_embeddings=[2_500_000],
    engram_max_ngram_size=4,
    engram_vocab_size=100_000,
    engram_n_heads=8,
    engram_head_dim=256,
    num_nextn_predict_layers=0,
    max_position_embeddings=65536,
    rope_scaling={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 65536},
)

V41_FLASH = {
    **V41_FLASH_8L,
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [2_500_000, 2_500_000],
}

# with V4.1-Flash's three DSpark draft stages (128 experts top-3, blocks of 5) reading its last three layers: the
# speculative benchmarks' fixture (the stages' attention is sliding-window only, as the release's trailing ratios)
V41_FLASH_8L_DSPARK = {
    **V41_FLASH_8L,
    "num_nextn_predict_layers": 3,
    "compress_ratios": V41_FLASH_8L["compress_ratios"] + [0, 0, 0],
    "dspark_block_size": 5,
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [5, 6, 7],
}


def dspark_layers(layers: int) -> dict:
    """Overrides that cut ``v41flash8Ldspark`` to its first ``layers`` target layers, the draft stages reading the
    last three (as the release's read its last layers)."""
    if not 3 <= layers <= V41_FLASH_8L["num_hidden_layers"]:
        raise ValueError(f"a DSpark fixture keeps 3 to {V41_FLASH_8L['num_hidden_layers']} target layers, got {layers}")
    return {"num_hidden_layers": layers, "compress_ratios": V41_FLASH_8L["compress_ratios"][:layers] + [0, 0, 0],
            "dspark_target_layer_ids": [layers - 3, layers - 2, layers - 1]}


# the same with six target layers, 14.8 GB of weights fewer, for an 80 GB H100, where the eight-layer one ran out of
# memory (77.7 GiB in use)
V41_FLASH_6L_DSPARK = {**V41_FLASH_8L_DSPARK, **dspark_layers(6)}

FIXTURES = {"flash4L": FLASH4L, "flash4Lfp8": FLASH4L_FP8, "v41flash8L": V41_FLASH_8L, "v41flash": V41_FLASH,
            "v41flash8Ldspark": V41_FLASH_8L_DSPARK, "v41flash6Ldspark": V41_FLASH_6L_DSPARK,
            "v41flash8Lvision": V41_FLASH_8L}
# fixtures with a vision tower: V4.1-Flash's (the release's vision_config: every key at its released value)
VISION = {"v41flash8Lvision": {"num_hidden_layers": 32}}


def write_fixture(name: str, out_dir: str | Path, **overrides) -> Path:
    """config.json (+ tokenizer) of fixture ``name`` in ``out_dir``; ``overrides`` shrink it for tests."""
    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; known: {sorted(FIXTURES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if name.startswith("v41"):
        from deepinfer.testing.tiny_v41 import write_v41_config

        write_v41_config(out, {**FIXTURES[name], **overrides}, tokenizer_vocab=TOKENIZER_VOCAB, vision=VISION.get(name))
        return out
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(**{**FIXTURES[name], **overrides})
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    build_tiny_tokenizer(out, vocab_size=TOKENIZER_VOCAB)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(FIXTURES))
    parser.add_argument("out_dir")
    parser.add_argument("--dspark-layers", type=int, metavar="N",
                        help="a DSpark fixture cut to N target layers (dspark_layers)")
    args = parser.parse_args()
    if args.dspark_layers and "dspark" not in args.name:
        parser.error(f"--dspark-layers applies to the DSpark fixtures, not {args.name}")
    print(write_fixture(args.name, args.out_dir, **(dspark_layers(args.dspark_layers) if args.dspark_layers else {})))
