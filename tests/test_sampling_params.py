import pytest

from deepinfer.sampling_params import SamplingParams

INVALID = [
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(n=1.0), "n must be an int, got 1.0"),
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(temperature="hot"), "temperature must be a finite number, got 'hot'"),
    (dict(temperature=0.0, n=2), "n must be 1 when temperature is 0 (greedy), got 2"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_k=-2), "top_k must be -1 or 0 (off) or >= 1, got -2"),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=None), "max_tokens must be an int, got None"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=17), "min_tokens must be <= max_tokens, got min_tokens=17, max_tokens=16"),
    (dict(logprobs=-2), "logprobs must be None, -1 (whole vocabulary) or >= 0, got -2"),
    (dict(logprobs=True), "logprobs must be an int, got True"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0, got 0"),
    (dict(seq_seed=-1), "seq_seed must be None or in [0, 2**63 - 1], got -1"),
    (dict(seq_seed=2**63), f"seq_seed must be None or in [0, 2**63 - 1], got {2**63}"),
    (dict(stop=""), "stop must be a str or a list of non-empty str, got ''"),
    (dict(stop=["a", ""]), "stop must be a str or a list of non-empty str, got ['a', '']"),
    (dict(stop=["a", 3]), "stop must be a str or a list of non-empty str, got ['a', 3]"),
    (dict(stop=7), "stop must be a str or a list of non-empty str, got 7"),
    (dict(stop_token_ids=[1, -1]), "stop_token_ids must be a list of non-negative int, got [1, -1]"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of non-negative int, got 5"),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
    (dict(skip_special_tokens=None), "skip_special_tokens must be a bool, got None"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output must be a bool, got 'yes'"),
    (
        dict(so_args={"schema": "a+"}),
        "so_args must be a dict with exactly the keys \"schema_type\" and \"schema\", got {'schema': 'a+'}",
    ),
    (
        dict(so_args={"schema_type": "regex", "schema": "a+", "strict": True}),
        "so_args must be a dict with exactly the keys \"schema_type\" and \"schema\", "
        "got {'schema_type': 'regex', 'schema': 'a+', 'strict': True}",
    ),
    (
        dict(so_args={"schema_type": "xml", "schema": "<a/>"}),
        "so_args['schema_type'] must be one of json, regex, ebnf, got 'xml'",
    ),
    (
        dict(so_args={"schema_type": "regex", "schema": {"type": "object"}}),
        "so_args['schema'] must be str for schema_type 'regex', got dict",
    ),
    (
        dict(so_args={"schema_type": "json", "schema": 3}),
        "so_args['schema'] must be str or dict for schema_type 'json', got int",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m.split(" ")[0] for _, m in INVALID])
def test_invalid_value_names_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert str(error.value) == message


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.seq_seed) == (16, 0, None, None)
    assert params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens and not params.include_stop_str_in_output and not params.ignore_eos


def test_stop_is_normalised_to_a_list_copy():
    assert SamplingParams(stop="###").stop == ["###"]
    stops, stop_ids = ["a", "b"], (7, 8)
    params = SamplingParams(stop=stops, stop_token_ids=stop_ids)
    stops.append("c")
    assert params.stop == ["a", "b"]
    assert params.stop_token_ids == [7, 8]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=0.0, n=1, top_k=-1),
        dict(n=4, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05),
        dict(min_tokens=16, max_tokens=16),
        dict(logprobs=-1),
        dict(logprobs=0),
        dict(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3),
        dict(seq_seed=0),
        dict(seq_seed=2**63 - 1),
        dict(stop=["</answer>", "\n\n"], stop_token_ids=[1], include_stop_str_in_output=True),
        dict(so_args={"schema_type": "json", "schema": {"type": "object"}}),
        dict(so_args={"schema_type": "json", "schema": '{"type": "object"}'}),
        dict(so_args={"schema_type": "ebnf", "schema": 'root ::= "yes" | "no"'}),
    ],
)
def test_valid_values_are_kept_as_given(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value
