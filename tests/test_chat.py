"""DeepSeek-V4's chat encoding, ``LLM.chat`` and ``LLM.stream``."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.chat_encoding import encode_chat

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
# Expected strings below are written out by hand from the format of DeepSeek's encoding_dsv4.py.


def _call(name, arguments, call_id=None):
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return call if call_id is None else {"id": call_id, **call}


def _dsml(*invokes):
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def _invoke(name, *parameters):
    rows = "\n".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in parameters)
    return f'<｜DSML｜invoke name="{name}">\n{rows}\n</｜DSML｜invoke>'


def test_plain_chat_and_thinking_mode():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encode_chat(chat) == f"{B}Be brief.{U}hi{A}</think>"
    assert encode_chat(chat, thinking=True) == f"{B}Be brief.{U}hi{A}<think>"
    assert encode_chat(chat[1:]) == f"{B}{U}hi{A}</think>"


def test_earlier_turns_are_replayed_without_their_reasoning():
    chat = [{"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "A greeting."},
            {"role": "user", "content": "Capital of France?"}, {"role": "user", "content": "One word."}]
    earlier = f"{B}{U}Hello{A}</think>Hi!{E}{U}Capital of France?\n\nOne word.{A}"  # one user turn of two messages
    assert encode_chat(chat) == earlier + "</think>"
    assert encode_chat(chat, thinking=True) == earlier + "<think>"


def test_tool_calls_and_results_in_call_order_then_a_follow_up():
    chat = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": [
                _call("get_weather", '{"city": "Paris", "days": 2}', "call_a"),
                _call("get_weather", {"city": "Rome", "days": 2}, "call_b")]},
            {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
            {"role": "tool", "tool_call_id": "call_a", "content": "sun"},
            {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
            {"role": "user", "content": "Thanks"}]
    calls = _dsml(_invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "2")),
                  _invoke("get_weather", ("city", "true", "Rome"), ("days", "false", "2")))
    assert encode_chat(chat, thinking=True) == (
        f"{B}{U}Weather in Paris and Rome?{A}</think>{calls}{E}"
        f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}</think>"
        f"Sunny in Paris, rainy in Rome.{E}{U}Thanks{A}<think>")


def test_argument_values_strings_as_is_others_as_json_and_text_that_is_not_json():
    chat = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "Running.", "tool_calls": [
                _call("f", '{"s": "二", "n": 1.5, "b": true, "x": null, "l": [1, "a"], "o": {"k": "v"}}'),
                _call("g", "not json"), _call("h", {})]},
            {"role": "tool", "content": "done"}]
    calls = _dsml(_invoke("f", ("s", "true", "二"), ("n", "false", "1.5"), ("b", "false", "true"),
                          ("x", "false", "null"), ("l", "false", '[1, "a"]'), ("o", "false", '{"k": "v"}')),
                  _invoke("g", ("arguments", "true", "not json")), '<｜DSML｜invoke name="h">\n\n</｜DSML｜invoke>')
    assert encode_chat(chat) == f"{B}{U}go{A}</think>Running.{calls}{E}{U}<tool_result>done</tool_result>{A}</think>"


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_SECTION = """

## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning \
inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{"name": "get_weather", "description": "Weather of a city", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # a backslash ending a line above joins it to the next: the section's long lines are one line each


def test_tool_definitions_follow_the_system_prompt_and_keep_every_turns_reasoning():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
             "tool_calls": [_call("get_weather", '{"city": "Paris"}', "c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    turns = (f"{U}Paris?{A}<think>Look it up.</think>{_dsml(_invoke('get_weather', ('city', 'true', 'Paris')))}{E}"
             f"{U}<tool_result>sun</tool_result>{A}<think>")
    assert encode_chat(chat, thinking=True, tools=[TOOL]) == f"{B}Be brief.{TOOLS_SECTION}{turns}"
    chat_mode = encode_chat(chat[1:2], tools=[TOOL])  # no system message: an empty one carries the tools
    assert chat_mode == f"{B}{TOOLS_SECTION}{U}Paris?{A}</think>"


MAX_EFFORT = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
              "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
              "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
              "Explicitly write out your entire deliberation process, documenting every intermediate step, "
              "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
              "unchecked.\n\n")


def test_max_reasoning_effort_opens_a_thinking_prompt():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encode_chat(chat, thinking=True, reasoning_effort="max") == f"{B}{MAX_EFFORT}Be brief.{U}hi{A}<think>"
    assert encode_chat(chat, thinking=True, reasoning_effort="high") == f"{B}Be brief.{U}hi{A}<think>"
    assert encode_chat(chat, reasoning_effort="max") == f"{B}Be brief.{U}hi{A}</think>"  # chat mode: no prefix


def test_developer_turns_before_the_last_user_turn_are_left_out_when_thinking():
    chat = [{"role": "developer", "content": "Search first."}, {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": "hi"}]
    assert encode_chat(chat) == f"{B}{U}Search first.{A}</think>Ok.{E}{U}hi{A}</think>"
    assert encode_chat(chat, thinking=True) == f"{B}Ok.{E}{U}hi{A}<think>"
    assert encode_chat(chat[:1], thinking=True) == f"{B}{U}Search first.{A}<think>"


@pytest.mark.parametrize("messages, kwargs, message", [
    ([], {}, "at least one message"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], {}, r"messages\[1\]: system messages"),
    ([{"role": "assistant", "content": "a"}], {}, r"messages\[0\]: an assistant message must follow"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], {}, "last message must be a user"),
    ([{"role": "bot", "content": "a"}], {}, r"messages\[0\]: role must be one of"),
    ([{"role": "user", "content": 3}], {}, r"messages\[0\]: a user message's content must be a str"),
    (["hi"], {}, r"messages\[0\] must be a dict"),
    ([{"role": "developer", "content": ""}], {}, "must not be empty"),
    ([{"role": "system", "content": "", "tools": [TOOL]}, {"role": "user", "content": "a"}], {}, "tools=\\[...\\]"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
      {"role": "tool", "content": "r"}], {}, r"messages\[1\].tool_calls\[0\] must be"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [_call("f", "[1]")]},
      {"role": "tool", "content": "r"}], {}, r"messages\[1\].tool_calls\[0\]: arguments must be a JSON object"),
    ([{"role": "user", "content": "a"}], {"reasoning_effort": "low"}, "reasoning_effort must be one of"),
    ([{"role": "user", "content": "a"}], {"tools": [{"name": "f"}]}, "tools must be a list of"),
])
def test_bad_conversations_are_refused(messages, kwargs, message):
    with pytest.raises(ValueError, match=message):
        encode_chat(messages, **kwargs)


@pytest.fixture(scope="module")
def llm():
    return LLM("deepinfer-tiny-v4.1", dtype="float32")  # bf16 rows of a batch of 2 may round apart


def test_chat_generates_from_the_encoded_prompt_and_takes_several_conversations(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    conversation = [{"role": "user", "content": "Write a function"}]
    ids = llm.tokenizer.encode(encode_chat(conversation), add_special_tokens=False)
    expected = llm.generate([ids], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outputs = llm.chat([conversation, conversation], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [expected, expected]
    assert outputs[0].prompt_token_ids == ids and ids.count(ids[0]) == 1  # one BOS: the encoding's own
    text = encode_chat(conversation, True, tools=[TOOL], reasoning_effort="max")
    assert llm.chat_prompt(conversation, True, [TOOL], "max") == llm.tokenizer.encode(text, add_special_tokens=False)


def test_stream_yields_the_text_generate_returns(llm):
    params = SamplingParams(temperature=0, max_tokens=12, stop=["time"])
    pieces = list(llm.stream("import os", params))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate("import os", params, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError, match="one completion"):
        next(llm.stream("x", SamplingParams(n=2, temperature=1)))
