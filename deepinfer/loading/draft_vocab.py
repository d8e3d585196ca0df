"""A draft vocabulary: the token ids a DSpark draft may propose (``EngineConfig.draft_vocab``,
``DEEPINFER_DRAFT_VOCAB``), and how to build one from text (``deepinfer draft-vocab``).

Each draft pass projects its block through the target's vocabulary head (V4.1's 129,280 x 5120 in bf16: 1.3 GB) and,
at every block position, through the Markov head (129,280 x 256 in fp32: 132 MB). At batch 1 on V4.1-Flash shapes
those reads are about a quarter of a verification step's bytes. Restricted to the tokens a text actually uses (as
FR-Spec and SGLang's ``--speculative-token-map`` restrict EAGLE's head), both shrink by the vocabulary's share. The
target still verifies with its whole vocabulary, so outputs do not change; a token outside the set is never drafted,
which costs acceptance where the text needs it.

The file: token ids as decimal integers, separated by whitespace (``deepinfer draft-vocab`` writes one a line, most
frequent first), ``#`` starting a comment to the end of its line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch


def read_draft_vocab(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The ids in ``path`` as an int64 tensor, sorted; a ValueError naming the file and the problem where one is
    not an integer, out of ``[0, vocab_size)``, repeated, or there is none."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"draft_vocab {str(path)!r} (DEEPINFER_DRAFT_VOCAB) is not a file")
    ids, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for word in line.split("#", 1)[0].split():
            try:
                token = int(word)
            except ValueError:
                raise ValueError(f"draft_vocab {str(path)!r}, line {number}: {word!r} is not a token id") from None
            if not 0 <= token < vocab_size:
                raise ValueError(f"draft_vocab {str(path)!r}, line {number}: token id {token} is outside the "
                                 f"model's vocabulary [0, {vocab_size})")
            if token in seen:
                raise ValueError(f"draft_vocab {str(path)!r}, line {number}: token id {token} is listed twice")
            seen.add(token)
            ids.append(token)
    if not ids:
        raise ValueError(f"draft_vocab {str(path)!r} lists no token id")
    return torch.tensor(sorted(ids), dtype=torch.int64)


def most_frequent_tokens(texts: Iterable[str], encode, size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``size`` token ids most frequent in ``texts`` (each encoded by ``encode``, text -> ids), most frequent
    first, ties by id; ``always`` (e.g. the end-of-sequence token) first, whatever their count."""
    if size < 1:
        raise ValueError(f"a draft vocabulary needs at least one token, got size={size}")
    counts = Counter()
    for text in texts:
        counts.update(encode(text))
    chosen = dict.fromkeys(always)  # ordered, and a membership test in O(1) (a list's is O(size) a token)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    return list(chosen)[:size]


def write_draft_vocab(path: str | Path, ids: list[int], source: str) -> None:
    """``ids`` one a line under a comment naming where they came from."""
    Path(path).write_text(f"# draft vocabulary: {len(ids)} token ids, most frequent first, from {source}\n"
                          + "".join(f"{token}\n" for token in ids))
