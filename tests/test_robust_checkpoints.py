"""Broken checkpoints (truncated shard, corrupt header, missing shard, bad config values, a pickle file): loading
refuses each with a ValueError/FileNotFoundError naming the file or the field, never another exception."""

import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM
from deepinfer.loading.checkpoint import CheckpointIndex
from deepinfer.loading.model_registry import model_config
from deepinfer.testing.tiny_v41 import build_tiny_v41

ERRORS = (ValueError, FileNotFoundError)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_v41(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def copy(tiny, tmp_path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny, target)
    return target


def load(directory: Path):
    return LLM(str(directory), dtype="float32")


def test_truncated_shard_is_named(copy):
    shard = copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        load(copy)


def test_missing_shard_named_by_the_index(copy):
    weight_map = {name: "model-00002-of-00002.safetensors" for name in CheckpointIndex.from_dir(copy).headers()}
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load(copy)


def test_pickle_only_checkpoint_is_refused_naming_the_directory(copy):
    (copy / "model.safetensors").rename(copy / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=f"No \\*.safetensors checkpoint in {copy}"):
        load(copy)


def write_header(shard: Path, header: bytes) -> None:
    shard.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)


HEADERS = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"[1, 2]", b'"text"', b"null", b'{"w": 5}', b'{"w": {"dtype": "F32"}}',
                     b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}',
                     b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}',
                     b'{"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}',
                     b'{"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}']),
)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(header=HEADERS)
def test_corrupt_header_is_named(tmp_path_factory, header):
    shard = tmp_path_factory.mktemp("corrupt") / "model.safetensors"
    write_header(shard, header)
    with pytest.raises(ValueError, match="model.safetensors"):
        CheckpointIndex.from_dir(shard.parent).headers()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_unreadable_config_is_named(copy, text):
    (copy / "config.json").write_text(text, errors="surrogateescape")
    with pytest.raises(ValueError, match="config.json"):
        model_config(copy)


BAD_VALUES = st.one_of(st.none(), st.just(0), st.integers(-2**40, -1), st.just(float("nan")), st.just(float("inf")),
                       st.text(max_size=3), st.lists(st.integers(), max_size=2))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(key=st.sampled_from(["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "n_routed_experts", "num_experts_per_tok", "rms_norm_eps", "sliding_window"]),
       value=BAD_VALUES)
def test_bad_config_values_are_named(tiny, key, value):
    d = json.loads((tiny / "config.json").read_text())
    d.setdefault("text_config", d)[key] = value
    with pytest.raises(ERRORS) as exc:
        type(model_config(tiny)).from_dict(d)
    assert key in str(exc.value) or repr(value) in str(exc.value), f"{key}={value!r}: {exc.value}"
