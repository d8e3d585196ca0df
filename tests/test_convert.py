"""deepinfer.loading.convert: float DeepSeek checkpoints -> the released FP8 + MXFP4 layout, sharded, with an index."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer.loading.convert import byte_size, convert_checkpoint, main, rules_for
from deepinfer.runtime.quantization import dequantize

FIXTURE = Path(__file__).parent / "fixtures" / "v41_tiny"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
FP8, FP4, E8M0 = torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu


def save_sharded(tensors: dict[str, torch.Tensor], directory: Path, parts: int) -> None:
    """Split a float checkpoint over ``parts`` source shards with an index, as downloads come."""
    names, weight_map = list(tensors), {}
    for i in range(parts):
        file = f"src-{i}.safetensors"
        chunk = names[i::parts]
        save_file({n: tensors[n] for n in chunk}, str(directory / file))
        weight_map.update(dict.fromkeys(chunk, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def read_output(directory: Path, max_bytes: int) -> dict[str, torch.Tensor]:
    """Every output tensor, after checking the index and the shard layout against each other."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) >= 3 and sorted(set(weight_map.values())) == files
    assert [SHARD.fullmatch(f).groups() for f in files] == [(f"{i:05d}", f"{len(files):05d}")
                                                              for i in range(1, len(files) + 1)]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        shard = load_file(str(directory / file))
        assert {n for n, f in weight_map.items() if f == file} == shard.keys()
        groups = {n.removesuffix(".scale").removesuffix(".weight") for n in shard}
        # the cap is on tensor data; a single weight (+ scale) bigger than it gets a shard of its own
        assert sum(t.nbytes for t in shard.values()) <= max_bytes or len(groups) == 1, file
        tensors.update(shard)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name in tensors:
        if name.endswith(".scale"):
            assert weight_map[name] == weight_map[name.removesuffix("scale") + "weight"], name
    return tensors


def check_values(source: dict[str, torch.Tensor], out: dict[str, torch.Tensor], block: tuple[int, int]) -> None:
    """Each output tensor holds its source tensor: exactly when cast, within the format's rounding when quantized."""
    for name, src in source.items():
        stored, x = out[name], src.float()
        scale = out.get(name.removesuffix("weight") + "scale")
        if scale is None:
            assert torch.equal(stored, src.to(stored.dtype)), name
            continue
        assert scale.dtype == E8M0, name
        rows, cols = x.shape
        if stored.dtype == FP4:
            tile, grid_max = (1, 32), 6.0
            assert stored.shape == (rows, cols // 2) and scale.shape == (rows, cols // 32), name
        else:
            tile, grid_max = ((1, 32) if "engram.embed" in name else block), 448.0  # V4.1's tables: row scales
            assert stored.shape == x.shape, name
            assert scale.shape == (-(-rows // tile[0]), -(-cols // tile[1])), name
        s = scale.float().repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]
        # Each tile's scale is the smallest power of two that fits its amax in the grid: amax in (max/2, max] * s.
        amax = torch.nn.functional.pad(x.abs(), (0, -cols % tile[1], 0, -rows % tile[0]))
        amax = amax.unflatten(0, (-1, tile[0])).unflatten(2, (-1, tile[1])).amax(dim=(1, 3))
        assert torch.all(amax <= grid_max * scale.float()) and torch.all(amax > grid_max / 2 * scale.float()), name
        # Round to nearest, so the error is half the grid step at x. e4m3 keeps 3 mantissa bits: <= 2^-4 |x| for
        # normal codes, and half the subnormal step, 2^-10 s, below 2^-6 s. MXFP4's e2m1 grid (0, .5, 1, 1.5, 2, 3,
        # 4, 6) * s keeps 1 bit: <= |x| / 4 from 1 s up (worst 1 s at 5 s, between 4 and 6), <= s / 4 below 1 s.
        rel, floor = (2**-2, 2**-2) if stored.dtype == FP4 else (2**-4, 2**-10)
        back = dequantize(stored, scale, torch.float32)
        assert torch.all((back - x).abs() <= torch.maximum(rel * x.abs(), floor * s)), name
        assert not torch.equal(back, x), name  # a lossless copy would mean nothing was quantized


# -- V4.1: random float weights in the shapes of the released-format fixture -----------------------------------------
@pytest.fixture(scope="module")
def released() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "model.safetensors"))


@pytest.fixture(scope="module")
def v41(released, tmp_path_factory):
    src = tmp_path_factory.mktemp("v41_bf16")
    g = torch.Generator().manual_seed(0)
    source = {}
    for name, tensor in released.items():
        if name.endswith(".scale"):
            continue
        shape = (tensor.shape[0], 2 * tensor.shape[1]) if tensor.dtype == FP4 else tensor.shape
        # rows of very different magnitudes, so tiles get different scales
        source[name] = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g).pow(4).mul(4)
                        if len(shape) == 2 else torch.randn(shape, generator=g)).bfloat16()
    save_sharded(source, src, parts=2)
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / file, src / file)
    dst = convert_checkpoint(src, src.parent / "v41_fp8", max_shard_bytes=256 * 1024, progress=False)
    return source, dst


def test_v41_output_matches_the_released_fixture_dtype_for_dtype(v41, released):
    source, dst = v41
    out = read_output(dst, 256 * 1024)
    assert {n: (t.dtype, t.shape) for n, t in out.items()} == {n: (t.dtype, t.shape) for n, t in released.items()}
    check_values(source, out, (32, 32))


def test_v41_config_and_other_files(v41):
    _, dst = v41
    config, original = (json.loads((d / "config.json").read_text()) for d in (dst, FIXTURE))
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                 "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    assert config == original  # the fixture is in the released format, config included
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / file).read_bytes() == (FIXTURE / file).read_bytes()
    assert not list(dst.glob("src-*")) and not list(dst.glob(".partial*"))


# -- V4: what HF's save_pretrained writes ("model." prefix) plus an MTP stage in DeepSeek's naming ---------------------
def expected_v4_dtype(name: str, source: torch.Tensor) -> torch.dtype:
    """The V4 release's format for a tensor (reference §6.3), spelled out independently of the converter's regexes."""
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if ".ffn.experts." in name:
        return FP4
    if name.endswith(".weight") and (leaf in ("wq_a", "wq_b", "wo_a", "wo_b", "e_proj", "h_proj")
                                     or ".shared_experts." in name or (leaf == "wkv" and "compressor" not in name)):
        return FP8
    if not source.is_floating_point():
        return source.dtype
    if leaf.startswith("hc_") or leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
        return torch.float32
    return torch.bfloat16


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from deepinfer.testing.tiny_v4 import build_tiny_v4

    src = build_tiny_v4(tmp_path_factory.mktemp("v4_fp32"), hidden_size=192)  # 192: a ragged 128 tile
    g = torch.Generator().manual_seed(1)
    mtp = {f"mtp.0.{n}": torch.randn(s, generator=g).bfloat16() for n, s in [
        ("e_proj.weight", (192, 192)), ("h_proj.weight", (192, 192)), ("enorm.weight", (192,)),
        ("hc_head_fn", (4, 768)), ("attn.wq_a.weight", (32, 192)), ("attn.attn_sink", (4,)),
        ("ffn.experts.0.w1.weight", (32, 192)), ("ffn.gate.bias", (8,)), ("ffn.gate.weight", (8, 192))]}
    save_file(mtp, str(src / "mtp.safetensors"))
    main_names = safe_open(str(src / "model.safetensors"), "pt").keys()
    weight_map = {**dict.fromkeys(main_names, "model.safetensors"), **dict.fromkeys(mtp, "mtp.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    main([str(src), str(src.parent / "v4_fp8"), "--max-shard-size", "128KB"])
    source = {**load_file(str(src / "model.safetensors")), **mtp}
    return src, source, src.parent / "v4_fp8"


def test_v4_rules_and_values(v4):
    _, source, dst = v4
    out = read_output(dst, 128 * 1024)
    renamed = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    source = {renamed.get(n, n).removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm."): t
              for n, t in source.items()}
    assert set(out) == set(source) | {n.removesuffix("weight") + "scale" for n, t in source.items()
                                      if expected_v4_dtype(n, t) in (FP8, FP4)}
    for name, tensor in source.items():
        assert out[name].dtype == expected_v4_dtype(name, tensor), name
    assert out["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert out["layers.0.attn.wq_a.scale"].shape == (1, 2)  # [32, 192] in 128 x 128 tiles
    check_values(source, out, (128, 128))


def test_v4_config_and_other_files(v4):
    src, _, dst = v4
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    config.pop("quantization_config")
    assert config == json.loads((src / "config.json").read_text())
    assert {p.name for p in dst.iterdir() if p.suffix != ".safetensors"} == {
        "config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json"}


def test_block_size_comes_from_the_config():
    assert rules_for({"model_type": "deepseek_v4"}).block == (128, 128)
    assert rules_for({"model_type": "deepseek_v4", "quantization_config": {"weight_block_size": [64, 64]}}).block == (
        64, 64)
    assert rules_for({"model_type": "deepseek_v41", "text_config": {}}).block == (32, 32)
    nested = {"model_type": "deepseek_v41", "text_config": {"quantization_config": {"weight_block_size": [128, 128]}}}
    assert rules_for(nested).block == (128, 128)
    with pytest.raises(ValueError, match="'llama' is not one of"):
        rules_for({"model_type": "llama"})


def test_sizes():
    assert byte_size("5GB") == 5 * 2**30 and byte_size("500MB") == 500 * 2**20 and byte_size("1234") == 1234
    with pytest.raises(ValueError, match="not a size"):
        byte_size("5 parsecs")


# -- refusals: nothing is written --------------------------------------------------------------------------------------
def float_checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return directory


def test_already_quantized_input_is_refused(tmp_path):
    weight, scale = torch.ones(32, 64).to(FP8), torch.ones(1, 1).to(E8M0)
    src = float_checkpoint(tmp_path / "fp8", {"layers.0.attn.wq_a.weight": weight, "layers.0.attn.wq_a.scale": scale,
                                              "embed.weight": torch.ones(8, 64)})
    with pytest.raises(ValueError, match="already quantized") as caught:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert "layers.0.attn.wq_a.weight (float8_e4m3fn, with a .scale)" in str(caught.value)
    with pytest.raises(ValueError, match="already quantized"):
        convert_checkpoint(FIXTURE, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_hf_in_memory_names_are_refused(tmp_path):
    src = float_checkpoint(tmp_path / "hf", {"model.layers.0.self_attn.q_a_proj.weight": torch.ones(32, 64),
                                             "lm_head.weight": torch.ones(8, 64)})
    with pytest.raises(ValueError, match="not in DeepSeek's original tensor naming") as caught:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert "model.layers.0.self_attn.q_a_proj.weight" in str(caught.value)
    assert "'layers.0.attn.wq_a.weight'" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_destination_must_be_new_or_empty_and_outside_the_source(tmp_path):
    src = float_checkpoint(tmp_path / "src", {"embed.weight": torch.ones(8, 64)})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty"):
        convert_checkpoint(src, tmp_path / "full", progress=False)
    for inside in (src, src / "fp8"):
        with pytest.raises(ValueError, match="inside the source checkpoint"):
            convert_checkpoint(src, inside, progress=False)
    assert (tmp_path / "full" / "keep.txt").read_text() == "x" and not (src / "fp8").exists()
