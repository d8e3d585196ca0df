"""Golden outputs for DeepSeek-V4.1 from NVIDIA NeMo AutoModel's public PyTorch implementation.

Runs in its own environment (NeMo AutoModel pins its own transformers), never in DeepInfer's:

    python3 -m venv /tmp/nemo && . /tmp/nemo/bin/activate
    pip install torch==2.13.0 && pip install --no-deps nemo-automodel==0.7.0
    pip install transformers==5.18.0 safetensors tokenizers numpy pyyaml pillow
    PYTHONPATH=. python tools/goldens/v41_golden.py tests/fixtures/v41_tiny 0 2   # weight seed, prompt seed

It builds a tiny random V4.1 (every layer kind: sliding-window, CSA2 ratio 2 and 1, KV-source sharing, re-index
and reuse layers, the two-level indexer, Engram, a window-only decoder layer), writes it in the released
checkpoint layout (FP8 32x32 block weights, MXFP4 experts, row-scaled FP8 Engram tables, bf16/fp32 elsewhere),
loads those files back through NeMo's own state-dict adapter and records, in fp32:

* ``golden.pt``: each prompt's token ids, its full-prompt logits, and a greedy continuation computed by
  re-running the whole sequence for every new token (the reference has no KV cache).

DeepInfer's tests load the same files and must reproduce these with paged caches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # eager SwiGLU: torch.compile on CPU is not bitwise eager

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from deepinfer.testing.tiny_tokenizer import build_tiny_tokenizer
from deepinfer.testing.tiny_v41 import TINY_V41, released_format
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

PROMPT_LENGTHS = (45, 21, 64)
GREEDY_TOKENS = 24


def released_tensors(native: dict[str, torch.Tensor], adapter) -> dict[str, torch.Tensor]:
    return released_format(adapter.to_hf(native))


def dspark_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """The DSpark draft stages ``mtp.*`` in the released layout (DeepInfer only loads and keeps them for now)."""
    text = config.text_config
    options = SimpleNamespace(
        num_draft_layers=text.num_nextn_predict_layers, target_layer_ids=text.dspark_target_layer_ids,
        block_size=text.dspark_block_size, num_anchors=4, mask_token_id=text.dspark_noise_token_id,
        markov_rank=text.dspark_markov_rank, markov_head_type="vanilla", confidence_head_alpha=1.0,
        confidence_head_with_markov=True, confidence_head_stop_gradient=False,
    )
    draft = config.build_dspark_draft(options).float()
    randomize(draft, seed + 2)
    tensors = released_tensors(draft.state_dict(), draft.state_dict_adapter)
    return {k: v for k, v in tensors.items() if k.startswith("mtp.")}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter NeMo initialises to a constant a random value, and make logits decisive."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("hc.base", "sinks_param.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("hc.scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("hc.fn"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed.weight"):  # Engram tables
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        if hasattr(model, "lm_head"):
            model.lm_head.weight.mul_(4.0)


def main(out_dir: str, seed: int = 0, prompt_seed: int = 1) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out, vocab_size=TINY_V41["vocab_size"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    _, compressed_vocab = _compressed_token_map(tokenizer)
    text = dict(TINY_V41, engram_compressed_vocab_size=compressed_vocab, dtype="float32")
    config = DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")
    torch.manual_seed(seed)
    backend = BackendConfig(attn="eager", experts="torch", dispatcher="torch", linear="torch", rms_norm="torch_fp32",
                            rope_fusion=False, enable_hf_state_dict_adapter=True)
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer).float()
    model.initialize_weights(dtype=torch.float32)
    randomize(model, seed)
    rows = [int(p) for p in model.model.engram_hash.primes.sum(-1).tolist()]

    tensors = released_tensors(model.state_dict(), model.state_dict_adapter)
    tensors.update(dspark_tensors(config, seed))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["text_config"]["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))

    # Load the files back through the reference's own adapter, so its weights are the checkpoint's.
    native = model.state_dict_adapter.from_hf({k: v.clone() for k, v in tensors.items()})
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in native.items()}, strict=False)
    missing = [k for k in missing if "engram_hash" not in k]
    if missing or unexpected:
        sys.exit(f"reference reload mismatch: missing {missing} unexpected {unexpected}")
    model.eval()

    g = torch.Generator().manual_seed(int(prompt_seed))
    goldens = []
    with torch.no_grad():
        for length in PROMPT_LENGTHS:
            prompt = [0] + torch.randint(3, TINY_V41["vocab_size"], (length - 1,), generator=g).tolist()
            logits = model(torch.tensor([prompt])).logits[0].float()
            ids = list(prompt)
            for _ in range(GREEDY_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            goldens.append({"prompt": prompt, "logits": logits, "greedy": ids[len(prompt):]})
            print(f"prompt {length}: greedy {ids[len(prompt):]}")
    torch.save({"goldens": goldens, "engram_prime_sums": rows, "nemo_automodel": "0.7.0"}, out / "golden.pt")
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
