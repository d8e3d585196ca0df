"""Held-out loss of the embedded model through DeepInfer's engine, weights kept FP8/MXFP4 and dequantized.

    PYTHONPATH=. python tools/training/eval_tiny_v41.py [--dtype float32] [--max-tokens 60000]

The held-out documents are the standard-library ``*.py`` files that ``tools/training/train_tiny_v41.py`` held out (3% by a
hash of the path, test packages included); this machine's Python decides which exist. Each is scored as
``BOS text EOS`` in windows of 512 tokens, as in training. Prints per-mode loss, perplexity, top-1 agreement and
the KL divergence of the kept-quantized distribution from the dequantized one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
from pathlib import Path

import torch

torch.set_flush_denormal(True)

from deepinfer import LLM  # noqa: E402
from deepinfer.loading.model_source import EMBEDDED_MODEL  # noqa: E402
from deepinfer.testing.probes import prefill_logits  # noqa: E402

WINDOW = 512
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}


def _bucket(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def heldout_windows(tokenizer, max_tokens: int) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    stream: list[int] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIP_DIRS & set(parts) or path.name.startswith("bad") or _bucket("/".join(parts)) >= 0.03:
            continue
        try:
            text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            stream += [0] + tokenizer.encode(text, add_special_tokens=False) + [1]
    stream = stream[:max_tokens + 1]
    return [stream[i: i + WINDOW + 1] for i in range(0, len(stream) - 1, WINDOW) if len(stream[i: i + WINDOW + 1]) > 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=60000)
    args = parser.parse_args()
    engines = {mode: LLM(EMBEDDED_MODEL, dtype=args.dtype, quantization=mode) for mode in ("auto", "none")}
    windows = heldout_windows(engines["auto"].engine.tokenizer, args.max_tokens)
    totals = {"auto": 0.0, "none": 0.0, "kl": 0.0, "agree": 0, "tokens": 0}
    for window in windows:
        inputs, targets = window[:-1], torch.tensor(window[1:])
        logits = {mode: prefill_logits(llm, inputs).float().log_softmax(-1) for mode, llm in engines.items()}
        for mode in ("auto", "none"):
            totals[mode] -= float(logits[mode].gather(1, targets[:, None]).sum())
        totals["kl"] += float((logits["none"].exp() * (logits["none"] - logits["auto"])).sum())
        totals["agree"] += int((logits["auto"].argmax(-1) == logits["none"].argmax(-1)).sum())
        totals["tokens"] += len(targets)
    n = totals["tokens"]
    result = {"dtype": args.dtype, "heldout_tokens": n, "windows": len(windows),
              **{f"loss_{mode}": totals[mode] / n for mode in ("auto", "none")},
              **{f"perplexity_{mode}": math.exp(totals[mode] / n) for mode in ("auto", "none")},
              "kl_dequantized_to_kept": totals["kl"] / n, "top1_agreement": totals["agree"] / n}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
