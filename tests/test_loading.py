"""Checkpoint loading: config dialects, RoPE frequencies, tensor names, shards, model directory resolution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from deepinfer import envs
from deepinfer.loading.model_source import DEFAULT_MODEL, EMBEDDED_MODEL, EMBEDDED_MODEL_DIR, resolve_model_dir
from deepinfer.loading.checkpoint import INDEX_FILE, CheckpointIndex
from deepinfer.loading.weights import load_state_dict
from deepinfer.models.deepseek_v4.config import DeepseekV4ModelConfig, YarnConfig, inv_freq
from deepinfer.models.deepseek_v4.weight_names import canonical_name, expert_slot, naming, split_fused_experts

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_HF = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3, index_n_heads=2, index_head_dim=16, index_topk=2,
    compress_ratios=[0, 4, 128], num_hash_layers=1, qk_rope_head_dim=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
)
OFFICIAL = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=129280, hidden_size=4096,
    num_hidden_layers=5, num_attention_heads=64, num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1024, o_lora_rank=1024, o_groups=8, sliding_window=128, moe_intermediate_size=2048,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=2, scoring_func="sqrtsoftplus",
    norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0, index_n_heads=64, index_head_dim=128,
    index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000,
    compress_rope_theta=160000, max_position_embeddings=1048576, num_nextn_predict_layers=1, bos_token_id=0,
    eos_token_id=1, tie_word_embeddings=False, torch_dtype="bfloat16", compress_ratios=[0, 0, 4, 128, 4, 0],
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                  "beta_slow": 1},
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(DeepseekV4Config(**TINY_HF))


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_saved")
    hf_model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def config(hf_dir):
    return DeepseekV4ModelConfig.from_dir(hf_dir)


@pytest.fixture(scope="module")
def loaded(hf_dir, config):
    return load_state_dict(hf_dir, expected_spec(config), naming=naming())


def expected_spec(c: DeepseekV4ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every canonical tensor and its shape, written from the architecture rather than from any checkpoint."""
    H, hc, f32 = c.hidden_size, c.hc_mult, torch.float32
    heads_dim, mix = c.num_heads * c.head_dim, (2 + hc) * hc
    spec = {"embed.weight": (c.vocab_size, H), "head.weight": (c.vocab_size, H), "norm.weight": (H,),
            "hc_head_fn": (hc, hc * H), "hc_head_base": (hc,), "hc_head_scale": (1,)}

    def compressor(prefix: str, ratio: int, dim: int) -> None:
        width = dim * (2 if ratio == c.csa_ratio else 1)  # CSA windows overlap, so they project twice the width
        spec.update({f"{prefix}.wkv.weight": (width, H), f"{prefix}.wgate.weight": (width, H),
                     f"{prefix}.ape": (ratio, width), f"{prefix}.norm.weight": (dim,)})

    for n, ratio in enumerate(c.compress_ratios):
        p, I, E = f"layers.{n}", c.moe_intermediate_size, c.n_routed_experts
        spec.update({f"{p}.attn_norm.weight": (H,), f"{p}.ffn_norm.weight": (H,)})
        for sub in ("attn", "ffn"):
            spec.update({f"{p}.hc_{sub}_fn": (mix, hc * H), f"{p}.hc_{sub}_base": (mix,), f"{p}.hc_{sub}_scale": (3,)})
        spec.update({
            f"{p}.attn.wq_a.weight": (c.q_lora_rank, H), f"{p}.attn.q_norm.weight": (c.q_lora_rank,),
            f"{p}.attn.wq_b.weight": (heads_dim, c.q_lora_rank), f"{p}.attn.wkv.weight": (c.head_dim, H),
            f"{p}.attn.kv_norm.weight": (c.head_dim,), f"{p}.attn.attn_sink": (c.num_heads,),
            f"{p}.attn.wo_a.weight": (c.o_groups * c.o_lora_rank, heads_dim // c.o_groups),
            f"{p}.attn.wo_b.weight": (H, c.o_groups * c.o_lora_rank),
            f"{p}.ffn.gate.weight": (E, H), f"{p}.ffn.experts.w1.weight": (E, I, H),
            f"{p}.ffn.experts.w3.weight": (E, I, H), f"{p}.ffn.experts.w2.weight": (E, H, I),
            f"{p}.ffn.shared_experts.w1.weight": (I, H), f"{p}.ffn.shared_experts.w3.weight": (I, H),
            f"{p}.ffn.shared_experts.w2.weight": (H, I),
            f"{p}.ffn.gate.tid2eid" if c.hash_layers[n] else f"{p}.ffn.gate.bias":
                (c.vocab_size, c.num_experts_per_tok) if c.hash_layers[n] else (E,),
        })
        if ratio:
            compressor(f"{p}.attn.compressor", ratio, c.head_dim)
        if ratio and c.has_indexer(n):
            compressor(f"{p}.attn.indexer.compressor", ratio, c.index_head_dim)
            spec.update({f"{p}.attn.indexer.wq_b.weight": (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                         f"{p}.attn.indexer.weights_proj.weight": (c.index_n_heads, H)})
    return {name: (shape, torch.int64 if name.endswith("tid2eid") else f32) for name, shape in spec.items()}


def original_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's own checkpoint layout: no prefix, one tensor per routed expert."""
    out = {}
    for name, tensor in state.items():
        if ".ffn.experts." in name:
            prefix, leaf = name.rsplit(".experts.", 1)
            out.update({f"{prefix}.experts.{e}.{leaf}": t.clone() for e, t in enumerate(tensor)})
        else:
            out[name] = tensor.clone()
    return out


def save_sharded(state: dict[str, torch.Tensor], directory: Path) -> list[str]:
    directory.mkdir()
    names = sorted(state)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for file, half in zip(files, halves):
        save_file({n: state[n] for n in half}, str(directory / file))
        weight_map.update(dict.fromkeys(half, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def assert_same(actual: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(actual[name], tensor), name


def test_hf_saved_checkpoint_loads_every_canonical_tensor(hf_model, config, loaded):
    assert {n: (tuple(t.shape), t.dtype) for n, t in loaded.items()} == expected_spec(config)
    hf_state = hf_model.state_dict()
    for layer in range(config.num_layers):
        experts = hf_model.model.layers[layer].mlp.experts
        inter = config.moe_intermediate_size
        assert torch.equal(loaded[f"layers.{layer}.ffn.experts.w1.weight"], experts.gate_up_proj[:, :inter])
        assert torch.equal(loaded[f"layers.{layer}.ffn.experts.w3.weight"], experts.gate_up_proj[:, inter:])
        assert torch.equal(loaded[f"layers.{layer}.ffn.experts.w2.weight"], experts.down_proj)
    assert torch.equal(loaded["layers.1.attn.kv_norm.weight"], hf_state["model.layers.1.self_attn.kv_norm.weight"])
    assert torch.equal(loaded["layers.1.attn.compressor.norm.weight"],
                       hf_state["model.layers.1.self_attn.compressor.kv_norm.weight"])
    assert torch.equal(loaded["layers.1.attn.indexer.compressor.ape"],
                       hf_state["model.layers.1.self_attn.compressor.indexer.position_bias"])
    # HF's in-memory names map onto the same canonical tensors.
    from_memory = {}
    for hf_name, tensor in hf_state.items():
        from_memory.update(split_fused_experts(canonical_name(hf_name), tensor))
    assert_same(loaded, from_memory)


def test_original_and_in_memory_namings_load_identically(hf_model, config, loaded, tmp_path):
    original = original_named(loaded)
    assert "layers.0.attn.kv_norm.weight" in original and "embed.weight" in original
    original["mtp.0.e_proj.weight"] = torch.zeros(4, 4)  # MTP tensors are skipped, not errors
    (tmp_path / "original").mkdir()
    save_file(original, str(tmp_path / "original" / "model.safetensors"))
    assert_same(load_state_dict(tmp_path / "original", expected_spec(config), naming=naming()), loaded)
    (tmp_path / "in_memory").mkdir()
    save_file(hf_model.state_dict(), str(tmp_path / "in_memory" / "model.safetensors"))
    assert_same(load_state_dict(tmp_path / "in_memory", expected_spec(config), naming=naming()), loaded)


def test_sharded_checkpoint_with_index(config, loaded, tmp_path):
    files = save_sharded(original_named(loaded), tmp_path / "sharded")
    assert CheckpointIndex.from_dir(tmp_path / "sharded").files == files
    assert_same(load_state_dict(tmp_path / "sharded", expected_spec(config), naming=naming()), loaded)


def test_load_casts_to_expected_dtype(hf_dir, config, loaded):
    spec = {n: (shape, torch.bfloat16 if dtype.is_floating_point else torch.int32)
            for n, (shape, dtype) in expected_spec(config).items()}
    as_bf16 = load_state_dict(hf_dir, spec, naming=naming())
    assert as_bf16["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert torch.equal(as_bf16["layers.2.ffn.experts.w2.weight"], loaded["layers.2.ffn.experts.w2.weight"].bfloat16())


def test_mismatches_are_reported_together_with_their_files(config, loaded, tmp_path):
    broken = original_named(loaded)
    del broken["layers.0.attn.wq_a.weight"], broken["layers.1.ffn.experts.3.w2.weight"]
    broken["layers.2.attn.wo_b.weight"] = torch.zeros(64, 16)
    broken["layers.2.attn.bogus.weight"] = torch.zeros(2)
    save_sharded(broken, tmp_path / "broken")
    with pytest.raises(ValueError) as caught:
        load_state_dict(tmp_path / "broken", expected_spec(config), naming=naming())
    message = str(caught.value)
    assert "missing tensors (2)" in message and "unexpected tensors (1)" in message
    assert "layers.0.attn.wq_a.weight" in message and "layers.1.ffn.experts.3.w2.weight" in message
    assert "layers.2.attn.bogus.weight (in model-00002-of-00002.safetensors)" in message
    assert "layers.2.attn.wo_b.weight (in model-00002-of-00002.safetensors): got (64, 16), expected (64, 32)" in message


def test_name_mapping_edge_cases():
    assert canonical_name("mtp.0.e_proj.weight") is None
    assert canonical_name("model.norm.weight") == "norm.weight"
    assert canonical_name("model.layers.0.attn.norm.weight") == "layers.0.attn.kv_norm.weight"
    assert canonical_name("model.layers.1.attn.indexer.compressor.norm.weight") == \
        "layers.1.attn.indexer.compressor.norm.weight"
    assert canonical_name("model.layers.3.self_attn.q_a_proj.weight_scale_inv") == "layers.3.attn.wq_a.scale"
    assert expert_slot("layers.3.ffn.experts.7.w1.scale") == ("layers.3.ffn.experts.w1.scale", 7)
    assert expert_slot("layers.3.ffn.shared_experts.w1.weight") is None


@pytest.fixture
def environ(monkeypatch):
    yield monkeypatch
    monkeypatch.undo()
    envs.reload()


def test_resolve_model_dir_override_and_local_dir(environ, hf_dir, tmp_path):
    environ.setenv("DEEPINFER_HF_MODEL_DIR", str(hf_dir))
    envs.reload()
    assert resolve_model_dir("someone/elsewhere") == hf_dir
    environ.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "absent"))
    envs.reload()
    with pytest.raises(FileNotFoundError, match="DEEPINFER_HF_MODEL_DIR"):
        resolve_model_dir(None)
    environ.delenv("DEEPINFER_HF_MODEL_DIR")
    envs.reload()
    assert resolve_model_dir(str(hf_dir)) == hf_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "absent"))


def test_resolve_model_dir_offline_and_uncached_is_explained(tmp_path):
    # A fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE and HF_HOME once, at import.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DEEPINFER_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path), PYTHONPATH=str(REPO_ROOT))
    script = ("from deepinfer.loading.model_source import DEFAULT_MODEL, EMBEDDED_MODEL, EMBEDDED_MODEL_DIR, resolve_model_dir\n"
              "print(resolve_model_dir(None))\n"
              "try:\n    resolve_model_dir(DEFAULT_MODEL)\nexcept FileNotFoundError as err:\n    print(err)\n")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    fallback, named = result.stdout.splitlines()
    # the default falls back to the embedded model, saying so once; a model the user named never does
    assert Path(fallback) == EMBEDDED_MODEL_DIR
    warnings = [line for line in result.stderr.splitlines() if EMBEDDED_MODEL in line]
    assert len(warnings) == 1 and "HF_HUB_OFFLINE is set" in warnings[0] and "DEEPINFER_HF_MODEL_DIR" in warnings[0]
    for needed in (DEFAULT_MODEL, "HF_HUB_OFFLINE", "DEEPINFER_HF_MODEL_DIR", str(tmp_path)):
        assert needed in named


def test_embedded_model_is_named_explicitly(environ):
    assert resolve_model_dir(EMBEDDED_MODEL) == EMBEDDED_MODEL_DIR


def test_config_from_hf_saved_json(config):
    assert (config.num_layers, config.compress_ratios, config.csa_ratio) == (3, [0, 4, 16], 4)
    assert [config.has_indexer(n) for n in range(3)] == [False, True, False]
    assert config.hash_layers == [True, False, False]
    assert (config.rope_head_dim, config.window, config.o_groups, config.hc_mult) == (8, 8, 2, 2)
    assert (config.rope_theta, config.compress_rope_theta, config.yarn) == (10000.0, 160000.0, None)
    assert (config.eos_token_id, config.dtype, config.quantization_config) == ([1], torch.float32, None)


def test_config_from_official_json():
    c = DeepseekV4ModelConfig.from_dict(OFFICIAL)
    assert c.compress_ratios == [0, 0, 4, 128, 4] and c.csa_ratio == 4
    assert c.hash_layers == [True, True, False, False, False]
    assert c.yarn == YarnConfig(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    assert (c.rope_head_dim, c.window, c.dtype) == (64, 128, torch.bfloat16)
    assert c.quantization_config == OFFICIAL["quantization_config"]


@pytest.mark.parametrize("change, message", [
    ({"model_type": "deepseek_v3"}, r"model_type 'deepseek_v3'.*\['deepseek_v4'\]"),
    ({"compress_ratios": [0, 0, 4]}, "compress_ratios has 3 entries but num_hidden_layers is 5"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types has 4 entries"),
    ({"mlp_layer_types": ["moe"] * 6}, "mlp_layer_types has 6 entries"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types has unknown entries"),
    ({"scoring_func": "relu"}, "scoring_func 'relu'"),
    ({"o_groups": 3}, "o_groups"),
    ({"qk_rope_head_dim": 1024}, "rope_head_dim"),
    ({"hidden_size": None}, "hidden_size"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
])
def test_config_rejects_bad_values(change, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV4ModelConfig.from_dict({**OFFICIAL, **change})


@pytest.mark.parametrize("hf_kwargs", [
    TINY_HF,
    {**TINY_HF, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    {k: v for k, v in OFFICIAL.items() if k != "model_type"},
], ids=["tiny", "tiny-yarn", "flash-yarn"])
def test_inv_freq_matches_transformers(hf_kwargs):
    hf_config = DeepseekV4Config(**hf_kwargs)
    rotary = DeepseekV4RotaryEmbedding(hf_config)
    sources = [hf_config.to_dict()] + ([OFFICIAL] if "rope_scaling" in hf_kwargs else [])
    for source in sources:
        ours = DeepseekV4ModelConfig.from_dict(source)
        assert torch.equal(inv_freq(ours, compressed=False), rotary.main_inv_freq)
        assert torch.equal(inv_freq(ours, compressed=True), rotary.compress_inv_freq)
    if hf_kwargs is not TINY_HF:
        assert not torch.equal(rotary.compress_inv_freq, DeepseekV4RotaryEmbedding(DeepseekV4Config(
            **{k: v for k, v in hf_kwargs.items() if k not in ("rope_parameters", "rope_scaling")})).compress_inv_freq)
