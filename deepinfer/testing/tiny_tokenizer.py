"""A small byte-level BPE tokenizer with DeepSeek's special tokens, built on the fly for tests.

Tests need a real tokenizer (merged multi-byte tokens, special tokens, BOS handling) without
downloading one. It is trained on the running Python's stdlib sources, which every machine has,
so it is deterministic for a given Python version.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
# Order fixes the ids: the trainer numbers special tokens first, so BOS = 0, EOS = 1, PAD = 2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")

# Enough stdlib text for useful merges while training well under a second.
_TRAINING_CORPUS_BYTES = 300_000
# The stdlib is almost pure ASCII; this gives the vocabulary some merged multi-byte tokens so
# tests exercise tokens that hold parts of several characters.
_MULTILINGUAL_SAMPLE = "héllo wörld café naïve 世界 你好 日本語 こんにちは привет ñandú €100 ½ → ✓\n"


def build_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train the tokenizer and save ``tokenizer.json`` + ``tokenizer_config.json`` into ``out_dir``."""
    smallest = len(SPECIAL_TOKENS) + 256
    if vocab_size < smallest:
        raise ValueError(f"vocab_size must be >= {smallest} (special tokens + 256 bytes), got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    # DeepSeek prepends BOS to every encoded prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(16384), indent=2, ensure_ascii=False))
    return out_dir


def _training_texts() -> list[str]:
    texts = [_MULTILINGUAL_SAMPLE * 50]
    remaining = _TRAINING_CORPUS_BYTES
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if remaining <= 0:
            break
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        texts.append(text)
        remaining -= len(text)
    return texts


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` for a DeepSeek-style fast tokenizer (BOS prepended, no EOS appended)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
