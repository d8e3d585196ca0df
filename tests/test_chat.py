"""DeepSeek-V4's chat encoding, ``LLM.chat`` and ``LLM.stream``."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.chat_encoding import encode_chat

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def test_encoding_of_turns_thinking_and_tool_results():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "weather?"},
                {"role": "tool", "content": "sunny"}]
    assert encode_chat(messages) == (f"{B}Be brief.{U}hi{A}</think>Hello.{E}"
                                     f"{U}weather?<tool_result>sunny</tool_result>{A}</think>")
    assert encode_chat(messages[1:2], thinking=True) == f"{B}{U}hi{A}<think>"


@pytest.mark.parametrize("messages, message", [
    ([], "at least one message"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system messages must come before"),
    ([{"role": "assistant", "content": "a"}], "must follow a user or tool message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message must be a user"),
    ([{"role": "bot", "content": "a"}], "role must be one of"),
    ([{"role": "user", "content": 3}], "must be a dict with a str 'content'"),
])
def test_bad_conversations_are_refused(messages, message):
    with pytest.raises(ValueError, match=message):
        encode_chat(messages)


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


def test_stream_yields_the_text_generate_returns(llm):
    params = SamplingParams(temperature=0, max_tokens=12, stop=["time"])
    pieces = list(llm.stream("import os", params))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate("import os", params, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError, match="one completion"):
        next(llm.stream("x", SamplingParams(n=2, temperature=1)))
