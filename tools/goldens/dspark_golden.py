"""Golden DSpark draft outputs for the embedded model, from NVIDIA NeMo AutoModel's public implementation.

Runs in NeMo AutoModel's own environment (see tools/goldens/v41_golden.py for the venv):

    PYTHONPATH=. /tmp/nemovenv/bin/python tools/goldens/dspark_golden.py tests/fixtures/dspark_golden.pt

Loads ``deepinfer-tiny-v4.1`` (the released layout) through NeMo's adapters, in fp32, runs a prompt through the
target capturing the DSpark features, then NeMo's draft backbone for two anchors of that prompt with teacher-forced
previous tokens (the prompt's own next tokens). Records the token ids, the anchors, each block's draft logits
(backbone logits + Markov bias) and confidence logits. DeepInfer's test must reproduce them from its own target
features and draft stages.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from tools.training.tiny_v41_model import FeatureCapture, build_models, load_released

CHECKPOINT = Path(__file__).parents[2] / "deepinfer" / "assets" / "tiny_v41"
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
          "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
ANCHORS = (20, 70)  # the second one past the 64-token window: its context starts at position 6


def main(out: Path) -> None:
    torch.manual_seed(0)
    raw = json.loads((CHECKPOINT / "config.json").read_text())
    raw["dtype"] = "float32"
    raw["text_config"]["dtype"] = "float32"
    config = DeepseekV41Config(**raw)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(CHECKPOINT))
    model, draft = build_models(config, tokenizer, torch.device("cpu"), num_anchors=1)
    load_released(model, draft, load_file(str(CHECKPOINT / "model.safetensors")), torch.device("cpu"))
    model.eval()
    draft.eval()
    capture = FeatureCapture(model, config.text_config.dspark_target_layer_ids)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        model(ids)
        features = capture.features()
        text = config.text_config
        block = text.dspark_block_size
        anchors = torch.tensor([ANCHORS])
        keep = torch.ones_like(anchors, dtype=torch.bool)
        tokens = torch.full((1, len(ANCHORS) * block), text.dspark_noise_token_id)
        tokens[0, ::block] = ids[0, anchors[0]]
        previous = torch.cat([ids[0, a : a + block] for a in ANCHORS]).view(1, -1)  # anchor, then its next tokens
        out_backbone = super(type(draft), draft).forward(
            draft.embed_tokens(tokens), features,
            position_ids=draft.build_position_ids(anchors, ids.shape[1]),
            attention_mask=draft.build_attention_mask(anchors, keep, ids.shape[1], torch.float32),
            previous_token_ids=previous)
        logits = draft.compute_logits(out_backbone.normalized_hidden_states) + out_backbone.transition_logits.float()
    torch.save({"token_ids": ids[0], "anchors": anchors[0], "previous": previous.view(len(ANCHORS), block),
                "features": features[0],
                "draft_logits": logits.view(len(ANCHORS), block, -1),
                "confidence_logits": out_backbone.confidence_pred.view(len(ANCHORS), block)}, out)
    print(f"wrote {out}: {len(ids[0])} tokens, anchors {ANCHORS}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
