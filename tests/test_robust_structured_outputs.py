"""Structured outputs under malformed and pathological ``so_args``: every schema, regex or grammar either runs (the
output then obeys it) or is refused with a ValueError that says ``so_args`` and what is wrong, before any request
is queued; never another exception, a crash or a hang. Hypothesis draws them (bounded, derandomized for CI)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.plugins.manager import registered

pytest.importorskip("xgrammar")
plugin = pytest.importorskip("deepinfer_structured_outputs.plugin")

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KEYWORDS = ["type", "properties", "required", "items", "anyOf", "allOf", "oneOf", "enum", "const", "minimum",
            "maximum", "minLength", "maxLength", "pattern", "additionalProperties", "$ref", "prefixItems",
            "minItems", "maxItems", "format", "not", "patternProperties", "multipleOf"]
# no subnormal floats: the test process flushes them to zero (conftest), which hypothesis refuses to draw under
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_subnormal=False)
                | st.text(max_size=8))
SCHEMAS = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(KEYWORDS) | st.text(max_size=4),
                                                                      children, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def llm():
    with registered(plugin, "structured_outputs"):
        llm = LLM("deepinfer-tiny-v4.1")
        llm.engine.structured_outputs()  # loaded while the plugin is registered (the engine keeps it)
    return llm


def _runs_or_is_refused(llm, so_args) -> str | None:
    """The output's text when the request ran; None when it was refused as it should be."""
    try:
        out = llm.generate(["x = "], SamplingParams(max_tokens=3, so_args=so_args), use_tqdm=False)
    except ValueError as exc:
        assert "so_args" in str(exc), str(exc)
        assert not llm.engine.has_unfinished()  # nothing of the refused batch was left queued
        return None
    assert len(out) == 1 and out[0].finished
    return out[0].outputs[0].text


@SETTINGS
@given(schema=SCHEMAS)
def test_json_schemas_run_or_are_refused_by_name(llm, schema):
    _runs_or_is_refused(llm, {"schema_type": "json", "schema": schema})


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from(list("ab(){}[]*+?|^$\\.,:0123456789-")), max_size=12))
def test_regexes_run_or_are_refused_by_name(llm, text):
    _runs_or_is_refused(llm, {"schema_type": "regex", "schema": text})


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from(list('root ::= "a" | b ( ) * + ? [ ] \n ab')), max_size=30))
def test_ebnf_grammars_run_or_are_refused_by_name(llm, text):
    _runs_or_is_refused(llm, {"schema_type": "ebnf", "schema": text})


@pytest.mark.parametrize("so_args, says", [
    ({"schema_type": "json", "schema": {"properties": [1]}}, "#/properties must be an object of schemas"),
    ({"schema_type": "json", "schema": {"type": "object", "required": 5}}, "#/required must be a list"),
    ({"schema_type": "json", "schema": {"anyOf": 5}}, "#/anyOf must be a list of schemas"),
    ({"schema_type": "json", "schema": "{not json"}, "not valid JSON"),
    ({"schema_type": "xml", "schema": "<a/>"}, "schema_type"),
    ({"schema_type": "regex", "schema": "(unclosed"}, "cannot be compiled"),
    ("json", "must be a dict"),
])
def test_malformed_so_args_name_the_problem(llm, so_args, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        llm.generate(["x"], SamplingParams(max_tokens=2, so_args=so_args), use_tqdm=False)


def test_a_schema_nested_past_the_limit_is_refused_not_a_recursion_error(llm):
    deep: dict = {"type": "array"}
    node = deep
    for _ in range(5000):
        node["items"] = {"type": "array"}
        node = node["items"]
    with pytest.raises(ValueError, match="nests deeper than"):
        llm.generate(["x"], SamplingParams(max_tokens=2, so_args={"schema_type": "json", "schema": deep}),
                     use_tqdm=False)


def test_valid_constraints_still_hold_the_output(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    out = llm.generate(["{"], SamplingParams(max_tokens=24, so_args={"schema_type": "json", "schema": schema}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text).keys() == {"a"}
    out = llm.generate(["x = "], SamplingParams(max_tokens=8, so_args={"schema_type": "regex", "schema": "[0-9]{3}"}),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[0-9]{3}", out.text)
