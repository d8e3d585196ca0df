"""The DSML tool-call parser (deepinfer/serve/tool_calls.py) on hand-written model outputs, well-formed and not:
a malformed block comes back whole as content, never dropped."""

import json

import pytest

from deepinfer.chat_encoding import DSML, _dsml
from deepinfer.serve.tool_calls import held_back, parse_tool_calls

D = DSML


def _block(*invokes):
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def _invoke(name, *parameters):
    return f'<{D}invoke name="{name}">\n' + "\n".join(parameters) + f"\n</{D}invoke>"


def _param(name, value, string=True):
    return f'<{D}parameter name="{name}" string="{"true" if string else "false"}">{value}</{D}parameter>'


def test_one_call_with_string_and_json_arguments():
    text = "Let me look." + _block(_invoke("get_weather", _param("city", "Paris"), _param("days", "3", False),
                                           _param("units", '["C", "F"]', False)))
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "units": ["C", "F"]}
    entry = calls[0].openai()
    assert entry["type"] == "function" and entry["id"].startswith("call_") and entry["function"]["name"] == "get_weather"
    assert calls[0].openai(index=2)["index"] == 2


def test_parallel_calls_keep_their_order_and_get_distinct_ids():
    text = _block(_invoke("a", _param("x", "1", False)), _invoke("b"), _invoke("c", _param("s", "multi\nline")))
    content, calls = parse_tool_calls(text)
    assert content == "" and [c.name for c in calls] == ["a", "b", "c"]
    assert [json.loads(c.arguments) for c in calls] == [{"x": 1}, {}, {"s": "multi\nline"}]
    assert len({c.id for c in calls}) == 3


def test_the_encoders_block_parses_back_to_its_calls():
    calls = [{"type": "function", "function": {"name": "search", "arguments": {"q": "pi", "k": 5, "deep": True}}},
             {"type": "function", "function": {"name": "open", "arguments": json.dumps({"url": "https://x"})}}]
    content, parsed = parse_tool_calls("Searching." + _dsml(calls))
    assert content == "Searching."
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("search", {"q": "pi", "k": 5, "deep": True}), ("open", {"url": "https://x"})]


def test_text_after_the_block_is_kept_as_content():
    content, calls = parse_tool_calls("Hi." + _block(_invoke("f")) + " trailing")
    assert content == "Hi. trailing" and [c.name for c in calls] == ["f"]


def test_no_block_is_plain_content():
    assert parse_tool_calls("just an answer") == ("just an answer", [])


@pytest.mark.parametrize("text", [
    "Hi." + f"\n\n<{D}tool_calls>\n" + _invoke("f", _param("x", "1")),                       # never closed
    "Hi." + _block(f'<{D}invoke name="f">\n' + _param("x", "1")),                            # invoke not closed
    "Hi." + _block(_invoke("f", _param("x", "not json", False))),                            # string="false", not JSON
    "Hi." + _block(_invoke("f", _param("x", "1"), _param("x", "2"))),                        # a repeated parameter
    "Hi." + _block("stray words", _invoke("f")),                                              # text between tags
    "Hi." + _block(_invoke("f", "junk " + _param("x", "1"))),                                # text inside an invoke
    "Hi." + _block(_invoke("")),                                                              # no function name
    "Hi." + _block(f'<{D}invoke name="f">\n<{D}parameter name="x">1</{D}parameter>\n</{D}invoke>'),  # no string=
    "Hi." + f"\n\n<{D}tool_calls>\n</{D}tool_calls>",                                         # an empty block
])
def test_a_malformed_block_comes_back_whole_as_content(text):
    assert parse_tool_calls(text) == (text, [])


def test_held_back_stops_before_a_block_or_a_tail_that_may_become_one():
    assert held_back("plain text") == len("plain text")
    assert held_back("Hi.\n\n<" + D[:2]) == 3
    assert held_back("Hi." + _block(_invoke("f"))) == 3
    assert held_back("a < b") == len("a < b")
    assert held_back("line\n") == 4  # a newline may precede a block: it waits


# -- the grammar that forces a call (tool_choice "required" or a named function) ----------------------------------

UNITS = {"type": "function", "function": {"name": "set_units", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"},
                                     "where": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                "near": {"type": "boolean"}},
                                               "required": ["near"]}},
    "required": ["unit"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                     "units": {"anyOf": [{"const": "metric"}, {"type": "null"}]}},
    "required": ["city"]}}}
NO_ARGUMENTS = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [UNITS, WEATHER, NO_ARGUMENTS]


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def grammar_accepts():
    """Whether a text is a whole answer of the forced-call grammar, matched token by token as the engine does."""
    pytest.importorskip("deepinfer_structured_outputs")
    from deepinfer_structured_outputs.plugin import XGrammarOutputs

    from deepinfer.loading.model_source import resolve_model_dir
    from deepinfer.loading.tokenizer import load_tokenizer
    from deepinfer.serve.tool_grammar import forced_call_grammar

    tokenizer = load_tokenizer(resolve_model_dir("deepinfer-tiny-v4.1"))
    outputs = XGrammarOutputs(tokenizer, len(tokenizer))

    def accepts(text, name=None, thinking=False):
        matcher = outputs.matcher({"schema_type": "ebnf", "schema": forced_call_grammar(TOOLS, name, thinking)})
        # whole: every token taken, then the end of text (EOS) too
        tokens = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return all(matcher.accept(t) for t in tokens) and matcher.terminated

    return accepts


def test_the_grammar_takes_the_encoders_blocks_of_allowed_calls(grammar_accepts):
    calls = [_call("set_units", unit="celsius", days=3, where={"city": "Oslo", "near": True}),
             _call("get_weather", city="São Paulo <3", tags=["a", "b"], units=None), _call("get_time")]
    assert grammar_accepts(_dsml(calls))
    assert grammar_accepts(_dsml([_call("set_units", unit="fahrenheit")]), name="set_units")
    assert grammar_accepts("Let me think.</think>" + _dsml([_call("get_time")]), thinking=True)
    # what is written parses back to the calls
    content, parsed = parse_tool_calls(_dsml(calls))
    assert content == "" and [json.loads(c.arguments) for c in parsed] == [c["function"]["arguments"] for c in calls]


@pytest.mark.parametrize("text, name", [
    (_dsml([_call("get_weather", city="x")]), "set_units"),                     # another tool than the named one
    (_dsml([_call("set_units", unit="celsius")] * 2), "set_units"),             # a named function: one call
    (_dsml([_call("send_mail", to="x")]), None),                                 # not a tool
    (_dsml([_call("set_units", days=3)]), None),                                 # a required parameter missing
    (_dsml([_call("set_units", unit="kelvin")]), None),                          # outside the enum
    (_dsml([_call("set_units", unit="celsius", days=2.5)]), None),               # not an integer
    (_dsml([_call("set_units", unit="celsius", where={"city": "Oslo"})]), None),  # a nested required member missing
    (_dsml([_call("get_weather", city="x", units="imperial")]), None),           # no anyOf option
    (_dsml([_call("get_weather", city="a </b")]), None),                         # "</" would close the tag
    ("Sure." + _dsml([_call("get_time")]), None),                                # text before the block
    (_dsml([_call("get_time")])[:-5], None),                                     # cut short
])
def test_the_grammar_refuses_anything_but_an_allowed_call(grammar_accepts, text, name):
    assert not grammar_accepts(text, name=name)


@pytest.mark.parametrize("parameters, where", [
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}, ".properties.n"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}, ".properties.s"),
    ({"type": "object", "properties": {}, "required": ["x"]}, ".required"),
    ({"type": "array"}, ""),
])
def test_a_schema_the_grammar_cannot_force_is_refused_naming_where(parameters, where):
    from deepinfer.serve.tool_grammar import ToolSchemaError, forced_call_grammar

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ToolSchemaError) as refused:
        forced_call_grammar([NO_ARGUMENTS, tool], None, False)
    assert refused.value.where == "tools[1].function.parameters" + where


# -- what is wrong with the calls of tool_choice "auto" -----------------------------------------------------------

def test_call_errors_flag_unknown_tools_and_arguments_that_break_the_schema():
    from deepinfer.serve.tool_calls import call_errors

    text = _dsml([_call("set_units", unit="kelvin"), _call("get_weather", city="Oslo"), _call("send_mail", to="x")])
    content, calls = parse_tool_calls(text)
    errors = call_errors(content, calls, TOOLS)
    assert [(e["index"], e["id"], e["name"]) for e in errors] == [(0, calls[0].id, "set_units"),
                                                                   (2, calls[2].id, "send_mail")]
    assert "['unit']" in errors[0]["message"] and "kelvin" in errors[0]["message"]
    assert "not in tools" in errors[1]["message"]
    assert call_errors(*parse_tool_calls(_dsml([_call("get_time")])), TOOLS) == []


def test_call_errors_flag_a_block_that_does_not_parse():
    from deepinfer.serve.tool_calls import call_errors

    text = "Hi." + _block(_invoke("f", _param("x", "not json", False)))
    content, calls = parse_tool_calls(text)
    assert content == text and calls == []
    (error,) = call_errors(content, calls, TOOLS)
    assert set(error) == {"message"} and "does not parse" in error["message"]
    assert call_errors("no block here", [], TOOLS) == []
