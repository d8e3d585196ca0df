"""SamplingParams drawn by hypothesis over every field (NaN, inf, wrong types, bools for ints, huge values): each is
kept as given or refused with a ValueError naming the field; extreme accepted values run to sane outputs."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams

# no subnormals: the suite flushes them to zero (tests/conftest.py), which hypothesis refuses to run under
FLOATS = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), FLOATS, st.text(max_size=4),
                      st.lists(st.one_of(st.integers(-3, 2**70), st.text(max_size=2)), max_size=3))
# field: whether a value is in its documented range (None: only through the check of another field)
INT_RANGES = {"n": lambda v: v >= 1, "top_k": lambda v: v >= -1, "max_tokens": lambda v: v >= 1,
              "min_tokens": lambda v: 0 <= v <= 16, "logprobs": lambda v: v >= -1,
              "seq_seed": lambda v: 0 <= v <= 2**63 - 1}
REAL_RANGES = {"temperature": lambda v: v >= 0, "top_p": lambda v: 0 < v <= 1, "min_p": lambda v: 0 <= v <= 1,
               "presence_penalty": lambda v: -2 <= v <= 2, "frequency_penalty": lambda v: -2 <= v <= 2,
               "repetition_penalty": lambda v: v > 0}
FLAGS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
NULLABLE = ("logprobs", "seq_seed")


def expected_valid(name, value):
    if value is None and name in NULLABLE:
        return True
    if name in INT_RANGES:
        return type(value) is int and INT_RANGES[name](value)
    if name in REAL_RANGES:
        return type(value) in (int, float) and math.isfinite(value) and REAL_RANGES[name](value)
    if name in FLAGS:
        return isinstance(value, bool)
    if name == "stop":
        strings = [value] if isinstance(value, str) else value
        return value is None or (isinstance(strings, list) and all(isinstance(s, str) and s for s in strings))
    assert name == "stop_token_ids"
    return value is None or (isinstance(value, list) and all(type(t) is int and t >= 0 for t in value))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted({*INT_RANGES, *REAL_RANGES, *FLAGS, "stop", "stop_token_ids"})), value=ANY_VALUE)
def test_every_field_is_kept_or_refused_by_name(name, value):
    # temperature 1 so that n > 1 is not refused for being greedy
    extra = {} if name == "temperature" else {"temperature": 1.0}
    try:
        params = SamplingParams(**extra, **{name: value})
    except ValueError as exc:
        assert not expected_valid(name, value), f"{name}={value!r} refused: {exc}"
        assert name in str(exc), f"{name}={value!r}: {exc}"
        return
    assert expected_valid(name, value), f"{name}={value!r} accepted"
    kept = getattr(params, name)
    if name == "stop":
        assert kept == ([] if value is None else [value] if isinstance(value, str) else value)
    elif name == "stop_token_ids":
        assert kept == ([] if value is None else value) and kept is not value
    else:
        assert kept is value  # not coerced: True stays refused, 1.0 is not turned into 1


@pytest.mark.parametrize("name, value", [("n", True), ("max_tokens", 4.0), ("max_tokens", True),
                                         ("top_k", 2.5), ("seq_seed", True), ("stop_token_ids", [True]),
                                         ("temperature", float("inf")), ("top_p", float("nan"))])
def test_lookalike_values_are_refused_not_coerced(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{"temperature": 1.0, name: value})


@pytest.fixture(scope="module")
def llm():
    return LLM("deepinfer-tiny-v4.1")


EXTREME = st.fixed_dictionaries({}, optional={
    "temperature": st.sampled_from([0.0, 1e-300, 1e300]), "top_k": st.sampled_from([1, 10**9]),
    "top_p": st.sampled_from([1e-300, 1.0]), "min_p": st.sampled_from([0.0, 1.0]),
    "max_tokens": st.sampled_from([1, 3]), "logprobs": st.sampled_from([0, 10**9]),
    "repetition_penalty": st.sampled_from([1e-300, 1e300]), "presence_penalty": st.sampled_from([-2, 2]),
    "stop_token_ids": st.sampled_from([[2**70], [0, 1, 2]]), "seq_seed": st.sampled_from([0, 2**63 - 1]),
})


# two examples: on a shared 2-core machine each costs about 40 s
@settings(max_examples=2, deadline=None, derandomize=True)
@given(fields=EXTREME)
def test_extreme_accepted_values_run_to_sane_outputs(llm, fields):
    prompts = [[5, 6, 7], "hello"]
    params = SamplingParams(**fields)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs][0] == prompts[0] and outputs[1].prompt == "hello"
    for output in outputs:
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason in ("stop", "length")
        assert 1 <= len(completion.token_ids) <= params.max_tokens
        assert all(0 <= t < llm.engine.model_config.vocab_size for t in completion.token_ids)
        if params.logprobs is not None:
            assert all(math.isfinite(lp.logprob) for step in completion.logprobs for lp in step.values())
