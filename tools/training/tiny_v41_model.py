"""NeMo AutoModel's DeepSeek-V4.1 model of the embedded checkpoint (``tools/training/train_tiny_v41.py``).

The trained configuration (``TRAINED_V41``), building NeMo's target and DSpark draft from it, the draft's shared
embedding and head, the capture of the DSpark target features, and the export to the released V4.1 layout
(FP8/MXFP4/``mtp.*``) with its reload through NeMo's own adapters.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from deepinfer.testing.tiny_v41 import released_format
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map, _next_prime
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.moe.layers import Gate

# Every layer kind of V4.1 in nine layers, as in deepinfer/testing/tiny_v41.py: 0-1 sliding window only (1 with
# Engram); 2 a ratio-2 KV and index source; 3 reuses 2's KV and selection; 4 re-indexes 2's keys; 5 a ratio-1 KV
# source that publishes candidate blocks; 6 reuses 5; 7 re-indexes inside 5's candidates (with Engram); 8 a
# window-only decoder layer. Then the three DSpark stages (window only), reading the inputs of layers 6-8.
# Sized for about 8 minutes of training on one H200 and a 15.2 MB checkpoint: 12.5M parameters (7.1M of them in the
# MXFP4 routed experts; 2 of 8 active) plus 2.5M in the draft. Training windows of 512 tokens against a 64-token
# sliding window make the compressed paths carry the context: ratio-2 layers see up to 256 entries and select 32;
# ratio-1 layers see up to 512, layer 5 keeps 8 candidate blocks of 8 and layer 7 selects 32 inside them.
TRAINED_V41 = dict(
    vocab_size=3072,
    hidden_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=9,
    num_attention_heads=8,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=32,
    o_groups=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    sliding_window=64,
    hc_mult=4,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0] + [0, 0, 0],  # + the three DSpark stages
    kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 4, 5, 7],
    index_n_heads=8,
    index_head_dim=32,
    index_topk=32,
    candidate_source_layer_id=5,
    candidate_topk_blocks=8,
    candidate_block_size=8,
    engram_layer_ids=[1, 7],
    engram_max_ngram_size=3,
    engram_vocab_size=2003,  # hash buckets per (n-gram size, head): primes just above this
    engram_n_heads=2,
    engram_head_dim=32,
    num_nextn_predict_layers=3,
    dspark_block_size=5,
    dspark_noise_token_id=2,  # <｜▁pad▁｜>: never a training target
    dspark_target_layer_ids=[6, 7, 8],
    dspark_markov_rank=32,
    dspark_n_routed_experts=4,
    dspark_num_experts_per_tok=2,
    max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 512},
)


# ---------------------------------------------------------------------------------------------------- model
def model_config(tokenizer: PreTrainedTokenizerFast, overrides: dict) -> DeepseekV41Config:
    text = dict(TRAINED_V41, **overrides)
    text["vocab_size"] = len(tokenizer)
    text["engram_compressed_vocab_size"] = _compressed_token_map(tokenizer)[1]
    text["engram_num_embeddings"] = engram_rows(text)
    text["dtype"] = "float32"  # fp32 master weights; bf16 autocast on GPU
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")


def engram_rows(text: dict) -> list[int]:
    """Each Engram table holds exactly its hash buckets: NeMo's primes for every (n-gram size, head)."""
    seen, rows = set(), []
    for _ in text["engram_layer_ids"]:
        total = 0
        for _ in range(text["engram_max_ngram_size"] - 1):
            current = text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                current = _next_prime(current, seen)
                seen.add(current)
                total += current
        rows.append(total)
    return rows


def build_models(config: DeepseekV41Config, tokenizer, device: torch.device, num_anchors: int,
                 grouped_experts: bool = False):
    """NeMo's target and DSpark draft. ``grouped_experts``: torch._grouped_mm experts (bf16 on GPU only)."""
    backend = BackendConfig(attn="sdpa", experts="torch_mm" if grouped_experts else "torch",
                            dispatcher="torch", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                            enable_hf_state_dict_adapter=True)
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer)
    model.initialize_weights(dtype=torch.float32)
    text = config.text_config
    options = SimpleNamespace(
        num_draft_layers=text.num_nextn_predict_layers, target_layer_ids=text.dspark_target_layer_ids,
        block_size=text.dspark_block_size, num_anchors=num_anchors, mask_token_id=text.dspark_noise_token_id,
        markov_rank=text.dspark_markov_rank, markov_head_type="vanilla", confidence_head_alpha=1.0,
        confidence_head_with_markov=True, confidence_head_stop_gradient=False,
    )
    draft = config.build_dspark_draft(options)
    for module in (*model.modules(), *draft.modules()):
        if isinstance(module, Gate):
            # DeepSeek's auxiliary-loss-free balancing: NeMo's MoEConfig for V4.1 leaves the bias update off (it
            # fine-tunes released weights); from scratch it keeps the routed experts in use.
            module.bias_update_factor = 1e-3
    return model.to(device), draft.to(device)


def sync_draft_embeddings(model, draft) -> None:
    """The draft reads the target's embedding and head (frozen copies; the release stores neither under mtp.*)."""
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(model.lm_head.weight)
    draft.set_embedding_head_trainable(False)


class FeatureCapture:
    """DSpark target features, as NeMo's ``HFDSparkTargetModel`` takes them from a V4.1 target.

    ``get_dspark_target_feature_modules`` names each target layer's attention hyper-connection: its input is the
    layer's residual streams [batch, seq, hc_mult, hidden] after any Engram update; the streams are averaged and
    the layers concatenated: [batch, seq, len(dspark_target_layer_ids) * hidden].
    """

    def __init__(self, model, layer_ids):
        self.captured: dict[int, torch.Tensor] = {}
        modules = model.get_dspark_target_feature_modules(list(layer_ids))
        self.layer_ids = list(layer_ids)
        for layer_id, module in zip(self.layer_ids, modules):
            module.register_forward_pre_hook(self._hook(layer_id))

    def _hook(self, layer_id):
        def hook(_module, inputs):
            self.captured[layer_id] = inputs[0].detach()
        return hook

    def features(self) -> torch.Tensor:
        out = torch.cat([self.captured[i].mean(dim=2) for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return out


# ---------------------------------------------------------------------------------------------------- export
def released_draft_tensors(draft) -> dict[str, torch.Tensor]:
    """The DSpark stages ``mtp.*`` in the released layout and dtypes."""
    drafted = draft.state_dict_adapter.to_hf({k: v.detach().cpu() for k, v in draft.state_dict().items()})
    return {k: v for k, v in released_format(drafted).items() if k.startswith("mtp.")}


def export(model, draft, config: DeepseekV41Config, out: Path) -> dict[str, torch.Tensor]:
    native = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    tensors = released_format(model.state_dict_adapter.to_hf(native))
    tensors.update(released_draft_tensors(draft))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["dtype"] = "bfloat16"
    config_dict["text_config"]["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    return tensors


def load_released(model, draft, tensors: dict[str, torch.Tensor], device) -> None:
    """Load the exported (quantized) tensors back through NeMo's own adapters, as tools/goldens/v41_golden.py does."""
    native = model.state_dict_adapter.from_hf({k: v.clone() for k, v in tensors.items() if not k.startswith("mtp.")})
    missing, unexpected = model.load_state_dict({k: v.float().to(device) for k, v in native.items()}, strict=False)
    missing = [k for k in missing if "engram_hash" not in k]
    if missing or unexpected:
        raise RuntimeError(f"reload mismatch: missing {missing} unexpected {unexpected}")
    mtp = {k: v.clone() for k, v in tensors.items() if k.startswith(("mtp.", "embed.", "head."))}
    native = draft.state_dict_adapter.from_hf(mtp)
    missing, unexpected = draft.load_state_dict({k: v.float().to(device) for k, v in native.items()}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"draft reload mismatch: missing {missing} unexpected {unexpected}")
    sync_draft_embeddings(model, draft)
