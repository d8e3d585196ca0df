"""Engine arguments drawn by hypothesis: each value is accepted unchanged or refused with a ValueError/TypeError
naming the argument (validation only: no model is built)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.engine.config import EngineConfig

BOUNDED = settings(max_examples=40, deadline=None, derandomize=True)
INTS = ("max_num_seqs", "max_num_batched_tokens", "data_parallel_size", "context_parallel_size",
        "eplb_step_interval")
OPTIONAL_INTS = ("max_model_len", "block_size", "num_cache_tokens")
FLAGS = ("enforce_eager", "enable_expert_parallel", "enable_eplb", "enable_chunked_prefill", "enable_prefix_caching")
CHOICES = ("dtype", "quantization", "kv_cache_dtype", "load_format")

# anything a caller might pass by mistake: wrong types, bools, NaN/inf, huge and negative numbers
# no subnormals: the suite flushes them to zero (tests/conftest.py), which hypothesis refuses to run under
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_subnormal=False),
                      st.text(max_size=8), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2),
                                                                                               st.integers(), max_size=1))


def build(name, value):
    """The config, or the error's message (which must name the argument)."""
    try:
        return EngineConfig.from_kwargs("model-dir", {name: value})
    except (ValueError, TypeError) as exc:
        assert name in str(exc), f"{name}={value!r}: {exc}"
        return None


@BOUNDED
@given(name=st.sampled_from(INTS + OPTIONAL_INTS), value=ANY_VALUE)
def test_integer_arguments(name, value):
    config = build(name, value)
    valid = type(value) is int and value >= 1
    if name in OPTIONAL_INTS and value is None:
        valid = True
    assert (config is not None) == valid, f"{name}={value!r}"
    if config is not None:
        assert getattr(config, name) is value


@BOUNDED
@given(name=st.sampled_from(FLAGS), value=ANY_VALUE)
def test_flags_take_only_bools(name, value):
    config = build(name, value)
    assert (config is not None) == isinstance(value, bool), f"{name}={value!r}"


@BOUNDED
@given(name=st.sampled_from(CHOICES), value=ANY_VALUE)
def test_choices_refuse_other_values_and_types(name, value):
    assert build(name, value) is None


@BOUNDED
@given(value=ANY_VALUE)
def test_kv_cache_memory_gb(value):
    config = build("kv_cache_memory_gb", value)
    valid = type(value) in (int, float) and 0 < value < math.inf
    assert (config is not None) == valid, f"kv_cache_memory_gb={value!r}"


@BOUNDED
@given(value=ANY_VALUE)
def test_seed(value):
    config = build("seed", value)
    assert (config is not None) == (type(value) is int and 0 <= value < 2**64), f"seed={value!r}"


@pytest.mark.parametrize("name, value", [("max_num_seqs", True), ("data_parallel_size", True),
                                         ("max_model_len", True), ("enable_chunked_prefill", "no"),
                                         ("enable_prefix_caching", 1), ("kv_cache_memory_gb", float("nan")),
                                         ("kv_cache_memory_gb", "4"), ("dtype", ["float32"]), ("seed", -1),
                                         ("seed", 1.5), ("tokenizer", 5)])
def test_values_once_accepted_or_crashing_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_kwargs("model-dir", {name: value})


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="max_num_seq'"):
        EngineConfig.from_kwargs("model-dir", {"max_num_seq": 4})
