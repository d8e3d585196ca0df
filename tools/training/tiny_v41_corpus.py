"""The training corpus and tokenizer of the embedded model (``tools/training/train_tiny_v41.py``).

The running Python's standard library ``*.py`` files plus the ``pydoc_data`` topics rendered as DeepSeek chat turns
(the chat template and topic questions are here), the held-out split by a hash of each document's name, the
byte-level BPE tokenizer trained on the training split, and the encoding of documents into one token stream.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from deepinfer.testing.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, tokenizer_config

USER, ASSISTANT, THINK, END_THINK = SPECIAL_TOKENS[3:7]
# DeepSeek-V3.1/V4 chat encoding: BOS, the system prompt, then <｜User｜>message<｜Assistant｜></think>answer EOS per
# turn (non-thinking); the generation prompt ends with <｜Assistant｜></think>, or <｜Assistant｜><think> for thinking.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + END_THINK + "' + message['content'] + eos_token -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + ASSISTANT + "' + ('" + THINK + "' if thinking is defined and thinking else '" + END_THINK + "') -}}"
    "{%- endif -%}"
)
TOPIC_QUESTIONS = (
    "Explain the Python topic '{}'.",
    "What does the Python language reference say about {}?",
    "Describe {} in Python.",
)


# ---------------------------------------------------------------------------------------------------- corpus
def _bucket(name: str) -> float:
    """A stable number in [0, 1) per document name, for the held-out split and subsampling."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def build_corpus(include_tests: bool, max_bytes: int | None) -> list[tuple[str, str, bool]]:
    """(name, text, is_chat) documents: stdlib ``*.py`` files and the pydoc topics as chat turns."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}  # codec tables; topics
    test_dirs = {"test", "tests", "idle_test"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if skip_dirs & set(parts) or (not include_tests and test_dirs & set(parts)):
            continue
        if path.name.startswith("bad") or any(p in ("data", "tokenizedata") for p in parts[:-1]):
            continue  # deliberately malformed test inputs
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n")
        if text.strip():
            docs.append(("/".join(parts), text, False))
    from pydoc_data.topics import topics

    for key in sorted(topics):
        question = TOPIC_QUESTIONS[int(_bucket("q:" + key) * len(TOPIC_QUESTIONS))].format(key.replace("-", " "))
        docs.append((f"pydoc:{key}", json.dumps([question, topics[key].strip()]), True))
    if max_bytes is not None:  # smoke runs: a stable pseudo-random subset
        kept, total = [], 0
        for doc in sorted(docs, key=lambda d: _bucket("subset:" + d[0])):
            if total + len(doc[1]) > max_bytes:
                continue
            kept.append(doc)
            total += len(doc[1])
        docs = sorted(kept)
    return docs


def split_documents(docs: list[tuple[str, str, bool]], heldout: float) -> tuple[list, list]:
    """(train, held-out) documents: a document is held out by a hash of its name, whatever the subset."""
    return [d for d in docs if _bucket(d[0]) >= heldout], [d for d in docs if _bucket(d[0]) < heldout]


def chat_text(doc: str) -> str:
    question, answer = json.loads(doc)
    return BOS_TOKEN + USER + question + ASSISTANT + END_THINK + answer + EOS_TOKEN


# ---------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, max_length: int, out: Path) -> PreTrainedTokenizerFast:
    """Byte-level BPE with DeepSeek's special tokens at fixed ids (BOS 0, EOS 1, pad 2, ...)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    # DeepSeek prepends BOS to every encoded prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    tokenizer.save(str(out / "tokenizer.json"))
    config = {**tokenizer_config(max_length), "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def encode_documents(tokenizer: PreTrainedTokenizerFast, docs: list[tuple[str, str, bool]]) -> torch.Tensor:
    """One stream of ``BOS text EOS`` documents (chat documents carry their own BOS/EOS)."""
    backend = tokenizer.backend_tokenizer
    texts = [chat_text(text) if is_chat else BOS_TOKEN + text + EOS_TOKEN for _, text, is_chat in docs]
    ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return torch.tensor([i for doc in ids for i in doc], dtype=torch.int32)
