"""deepinfer serve's tools, logprobs, load and disconnects, through OpenAI's client on a loopback port: tool calls
parsed from a DSML block (fed by a fake engine loop, since the tiny model does not write DSML), tools rendered into
the prompt as LLM.chat renders them, logprobs equal to offline generate's, 64 concurrent streams equal to offline
generate at temperature 0, and a non-streaming request whose client leaves is aborted with its blocks freed."""

import asyncio
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.chat_encoding import _dsml  # noqa: E402
from deepinfer.serve.app import create_app  # noqa: E402
from deepinfer.serve.engine_loop import Admitted, Delta, deliver  # noqa: E402
# the same module-scoped fixtures (a server admitting 64 requests, its client, the offline engine, one intra-op
# thread), one per module
from test_serve import (MODEL, PROMPTS, _client, _serve, _stop, client, offline,  # noqa: E402, F401
                        one_intra_op_thread, server, structured_plugin)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]


class _ScriptedLoop:
    """Stands in for EngineLoop: every submission is admitted and answered with ``text``, a few characters a delta,
    so the HTTP side (parsing, streaming, finish reasons) runs as it does over the engine."""

    alive, counters, max_model_len = True, {}, 4096

    def __init__(self, text: str):
        self.text, self.prompts = text, []

    def submit(self, submission):
        self.prompts.append(submission.prompt)
        pieces = [self.text[i:i + 7] for i in range(0, len(self.text), 7)]
        deliver([(submission, Admitted(3))] + [(submission, Delta(0, piece, k + 1, "stop" if k == len(pieces) - 1
                                                                   else None)) for k, piece in enumerate(pieces)])

    def abort(self, submission):
        pass


@pytest.fixture(scope="module")
def scripted():
    loop = _ScriptedLoop("Let me check." + _dsml(CALLS))
    config = uvicorn.Config(create_app(loop, MODEL), host="127.0.0.1", port=0, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield loop, _client(f"http://127.0.0.1:{port}")
    _stop(uv, thread)


def test_a_dsml_block_comes_back_as_tool_calls(scripted):
    loop, client = scripted
    messages = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0]
    assert got.finish_reason == "tool_calls" and got.message.content == "Let me check."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris", "days": 3}), ("function", "get_weather", {"city": "Oslo"})]
    assert len({c.id for c in got.message.tool_calls}) == 2
    assert "get_weather" in loop.prompts[-1] and "## Tools" in loop.prompts[-1]  # rendered for the model

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."  # the block itself never streams as text
    streamed = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
        (0, "get_weather", {"city": "Paris", "days": 3}), (1, "get_weather", {"city": "Oslo"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_block_is_content(scripted):
    loop, client = scripted
    messages = [{"role": "user", "content": "Weather?"}]
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        got = client.chat.completions.create(model=MODEL, messages=messages, **extra).choices[0]
        assert got.finish_reason == "stop" and got.message.content == loop.text and not got.message.tool_calls
        assert "## Tools" not in loop.prompts[-1]


def test_a_conversation_with_tool_results_is_encoded(scripted):
    loop, client = scripted
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert "<tool_result>sunny</tool_result>" in loop.prompts[-1]
    assert 'invoke name="get_weather"' in loop.prompts[-1]


@pytest.mark.parametrize("fields, param", [({"tools": [{"type": "function"}]}, "tools[0]"),
                                           ({"tool_choice": "auto"}, "tool_choice"),
                                           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice")])
def test_bad_tools_are_a_400_naming_the_field(scripted, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        scripted[1].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], **fields)
    assert refused.value.body["param"] == param


def test_tools_reach_the_model_as_llm_chat_renders_them(client, offline):
    """The tiny model writes no DSML: its answer comes back as content, the same as offline chat with the tools."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0)
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16), tools=TOOLS, use_tqdm=False)
    assert got.choices[0].message.content == want[0].outputs[0].text
    assert got.choices[0].finish_reason == want[0].outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want[0].prompt_token_ids)


def test_completion_logprobs_equal_offline_generate(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3)
    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)
    want = want[0].outputs[0]
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([entry[t].logprob for t, entry in zip(want.token_ids, want.logprobs)])
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) <= 3 and max(top.values()) >= value for top, value in zip(lp.top_logprobs, lp.token_logprobs))

    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3,
                                       stream=True)
    streamed = [v for c in stream if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "Say hi."}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2).choices[0]
    content = got.logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == got.message.content
    for token in content:
        assert token.bytes == list(token.token.encode()) and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled token is the most likely
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, top_logprobs=2)
    assert refused.value.body["param"] == "top_logprobs"


@pytest.fixture(scope="module")
def invariant():
    """A server and an offline LLM in batch-invariant mode: 64 streams arrive over many steps, so their batches
    differ from offline generate's one batch of 64, and float32 alone lets a near-tie of the tiny model go either
    way (seen: one prompt in 64). The mode makes each row's logits independent of its batch mates."""
    pytest.importorskip("deepinfer_batch_invariant")
    import importlib

    from deepinfer import envs
    from deepinfer.plugins.manager import registered
    from deepinfer_batch_invariant import cpu_checks

    problems = cpu_checks.cpu_problems(16)
    if problems:
        pytest.skip("; ".join(problems))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        envs.reload()
        with registered(importlib.import_module("deepinfer_batch_invariant.plugin"), "batch_invariant"):
            loop, uv, thread, url = _serve(["--max-queued", "64"])
            offline = LLM(MODEL, dtype="float32")
    envs.reload()
    yield loop, url, offline
    _stop(uv, thread, loop)


def test_64_concurrent_streams_equal_offline_generate(invariant):
    server, offline = invariant[:2], invariant[2]
    prompts = [f"{p}  # {i}" for i in range(8) for p in PROMPTS]
    want = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8),
                                                        use_tqdm=False)]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        limits = httpx.Limits(max_connections=len(prompts))
        async with openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0,
                                      http_client=httpx.AsyncClient(limits=limits, timeout=60)) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert got == want


def test_a_non_streaming_client_that_leaves_is_aborted(server):
    loop, url = server
    before = dict(loop.counters)
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting and closes its connection
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=1.0))
    deadline = time.monotonic() + 20
    while not (loop.counters["aborted_requests"] == before["aborted_requests"] + 1
               and loop.counters["running"] == 0 and loop.counters["waiting"] == 0):
        assert time.monotonic() < deadline, loop.counters
        time.sleep(0.05)
    assert loop.counters["generation_tokens"] - before["generation_tokens"] < 2000  # it stopped early
    assert loop.counters["cache_usage"] == before["cache_usage"]  # its blocks went back


def test_the_engines_refusals_name_their_field(server, client):
    """EngineLoop._admit maps each check's refusal to its own field: the prompt's length, the schema."""
    too_long = [5] * (server[0].max_model_len + 1)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=1)
    assert refused.value.body["param"] == "prompt" and "max_model_len" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"min_tokens": 2})
    assert refused.value.body["param"] == "response_format"


# -- tool_choice "required" and named functions: the structured-outputs grammar of a DSML block ------------------

UNITS = [{"type": "function", "function": {"name": "set_units", "description": "The units of the forecast.",
                                           "parameters": {"type": "object", "required": ["unit", "metric"],
                                                          "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                                                         "metric": {"type": "boolean"}}}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": {"type": "object", "properties": {}}}}]
needs_grammars = pytest.mark.skipif(structured_plugin is None, reason="features/structured_outputs is not installed")


def _valid_calls(message, tools) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, each checked against its tool's parameters schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    return calls


@needs_grammars
def test_a_named_function_is_called_with_arguments_that_match_its_schema(client):
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=UNITS, max_tokens=300, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "set_units"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [name for name, _ in _valid_calls(choice.message, UNITS)] == ["set_units"]
    assert "tool_call_errors" not in (choice.message.model_extra or {})


@needs_grammars
def test_required_makes_the_model_call_a_tool(server, client):
    # the tiny model, forced into the block, repeats calls until max_tokens; a bias on "</" (allowed by the grammar
    # only where a tag closes) ends the block after the first call
    close = server[0].tokenizer.convert_tokens_to_ids("</")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=UNITS, tool_choice="required",
        max_tokens=300, temperature=0, logit_bias={str(close): 100}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas)  # the block never streams as text
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert len(calls) >= 1 and {c.function.name for c in calls} <= {"set_units", "get_time"}


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "send_mail"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"), ({"tool_choice": {"function": "f"}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}}]},
     "tools[0].function.parameters.properties.n"),
])
def test_a_forced_call_that_cannot_be_made_is_a_400_naming_the_field(scripted, fields, param):
    loop, client = scripted
    submitted = len(loop.prompts)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       **{"tools": UNITS, **fields})
    assert refused.value.body["param"] == param and len(loop.prompts) == submitted  # refused before the engine


def test_calls_that_break_their_schema_come_back_flagged(scripted):
    loop, client = scripted
    wrong = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}},
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    text, loop.text = loop.text, "Checking." + _dsml(wrong)
    try:
        messages = [{"role": "user", "content": "Weather?"}]
        got = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0]
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True))
    finally:
        loop.text = text
    # what the model wrote is returned as written; the call that breaks the schema is named, with why
    assert got.finish_reason == "tool_calls" and got.message.content == "Checking."
    assert [json.loads(c.function.arguments) for c in got.message.tool_calls] == [
        {"city": "Paris", "days": "3"}, {"city": "Oslo"}]
    (error,) = got.message.model_extra["tool_call_errors"]
    assert error["index"] == 0 and error["id"] == got.message.tool_calls[0].id and "['days']" in error["message"]
    streamed = [e for c in chunks if c.choices for e in (c.choices[0].delta.model_extra or {}).get(
        "tool_call_errors", ())]
    assert [e["index"] for e in streamed] == [0]


# -- echo, logit_bias ------------------------------------------------------------------------------------------

def test_echo_leads_each_choice_with_its_prompt(server, client):
    ids = server[0].tokenizer.encode(PROMPTS[0])
    plain = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=6, temperature=0,
                                       echo=True)
    assert [c.text for c in echoed.choices] == [PROMPTS[1] + plain.choices[0].text, PROMPTS[2] + plain.choices[1].text]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=1, seed=5, n=2, echo=True,
                                       stream=True)
    texts = ["", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    prompt_text = server[0].tokenizer.decode(ids)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=1, seed=5, n=2)
    assert texts == [prompt_text + c.text for c in whole.choices]


def test_logit_bias_forces_bans_and_keeps_seeded_sampling_deterministic(server, client, offline):
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                       logit_bias={"100": 100})
    assert forced.choices[0].text == server[0].tokenizer.decode([100] * 6)
    greedy = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    ban = {t: -100 for t in greedy[0].outputs[0].token_ids}
    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, logit_bias=ban), use_tqdm=False)
    assert not set(want[0].outputs[0].token_ids) & set(ban)
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                       logit_bias={str(t): b for t, b in ban.items()})
    assert banned.choices[0].text == want[0].outputs[0].text
    args = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, seed=11, logit_bias={"100": 3})
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_logit_bias_ids_outside_the_vocabulary_are_refused_offline(offline):
    vocab = offline.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias has token ids outside the vocabulary \[0, {vocab}\)"):
        offline.generate("x", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        next(offline.stream("x", SamplingParams(logit_bias={vocab + 5: 1.0})))
    assert not offline.engine.has_unfinished()  # refused before anything was queued


def test_bench_serve_against_a_running_server_by_base_url(server, tmp_path, capsys):
    from deepinfer.cli import main

    loop, url = server
    before = loop.counters["finished_requests"]
    main(["bench", "serve", "--base-url", url, "--model", MODEL, "--num-prompts", "3", "--random-input-len", "6",
          "--random-output-len", "3", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path)])
    (saved,) = tmp_path.glob("*.json")
    result = json.loads(saved.read_text())
    assert result["completed"] == 3 and result["failed"] == 0 and result["total_output_tokens"] == 9
    # the loop copies its counters after it has routed a step's outputs, so the bench may return first (seen beside
    # another CPU job: 2 of the 4 not yet counted)
    deadline = time.monotonic() + 20
    while loop.counters["finished_requests"] - before < 3 + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.counters["finished_requests"] - before == 3 + 1  # this server ran them, and the warm-up
    assert "Serving Benchmark Result" in capsys.readouterr().out
