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
