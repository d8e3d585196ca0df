"""deepinfer serve against OpenAI's own client: a server on a loopback port, the embedded model, outputs equal to
offline LLM.generate at temperature 0, streams, continuous batching across requests, errors, disconnects."""

import argparse
import asyncio
import re
import socket
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.plugins.manager import registered  # noqa: E402
from deepinfer.cli import serve as cli  # noqa: E402

try:
    from deepinfer_structured_outputs import plugin as structured_plugin
except ImportError:  # features/structured_outputs not installed: the response_format test skips
    structured_plugin = None

MODEL = "deepinfer-tiny-v4.1"
ENGINE = ["--model", MODEL, "--dtype", "float32"]  # bf16 rows of a batch may round apart: float32 batches alike
PROMPTS = ["import os", "def fibonacci(n):", "class Stack:", "for i in range(", "# sort a list",
           "def main():", "import numpy as np", "x = [1, 2, 3]"]


def _serve(extra=()):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    # the engine on a thread of this process: the tests read its engine (test_serve_process.py: in its own)
    loop, app = cli.build(parser.parse_args([*ENGINE, "--no-engine-process", *extra]))
    if structured_plugin is not None:  # under test installed plugins are not loaded: the engine takes it now
        with registered(structured_plugin, "structured_outputs"):
            loop.engine.structured_outputs()
    loop.start()
    return (loop, *_listen(app))


def _listen(app):
    """``app`` served by uvicorn on a thread, on a free loopback port: (server, thread, url) once it accepts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def _stop(uv, thread, loop=None):
    uv.should_exit = True
    thread.join()
    if loop is not None:
        loop.stop()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """The engine's thread, uvicorn's and the client's share this process: where OMP_NUM_THREADS gives torch a second
    intra-op thread (conftest.py sets one unless told), it spins between ops on the core the other threads need, and
    every step takes ~2x as long on 2 cores. Set before the module's server starts (autouse runs first in its scope),
    restored after it stops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    loop, uv, thread, url = _serve(["--max-queued", "64"])  # test_serve_features: 64 streams at once
    yield loop, url
    _stop(uv, thread, loop)


@pytest.fixture(scope="module")
def client(server):
    return _client(server[1])


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, dtype="float32")


def _greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_health_and_models(server, client):
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_offline_generate(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0)
    want = offline.generate(PROMPTS[1], _greedy(24), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)


def test_chat_equals_offline_chat(client, offline):
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    want = offline.chat(messages, _greedy(24), use_tqdm=False)[0].outputs[0]
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"


def test_streams_concatenate_to_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20,
                                                                     temperature=0, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_concurrent_streams_are_batched_and_match_offline(server, offline):
    """Eight streams at once, each admitted as it arrives: every one ends with offline generate's text."""
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, _greedy(16), use_tqdm=False)]
    steps_before = server[0].counters["steps"]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert asyncio.run(all_of_them()) == want
    # one generate per request would take 8 x 16 steps; batched, far fewer
    assert server[0].counters["steps"] - steps_before < 4 * 16


def test_n_and_seed(client):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=2, seed=7)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [c.text for c in again.choices]


@pytest.mark.parametrize("fields, param", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                           ({"max_tokens": 0}, "max_tokens"), ({"frobnicate": 1}, "frobnicate"),
                                           ({"logprobs": 21}, "logprobs"), ({"seed": -3}, "seed"),
                                           ({"logit_bias": {"5": 101}}, "logit_bias"),
                                           ({"logit_bias": {"five": 1}}, "logit_bias"),
                                           ({"logit_bias": {"99999": 1}}, "logit_bias"),  # outside the vocabulary
                                           ({"suffix": "x"}, "suffix"), ({"echo": True, "logprobs": 1}, "echo")])
def test_a_bad_field_is_a_400_naming_it(server, fields, param):
    response = httpx.post(server[1] + "/v1/completions", json={"model": MODEL, "prompt": "x", **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_not_json_is_a_400(server):
    response = httpx.post(server[1] + "/v1/completions", content=b"{bad json",
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] is None


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_disconnect_aborts_the_request(server):
    loop, url = server
    aborted = loop.counters["aborted_requests"]
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 500,
                                                              "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while not (loop.counters["aborted_requests"] == aborted + 1 and loop.counters["running"] == 0
               and loop.counters["waiting"] == 0):
        assert time.monotonic() < deadline, loop.counters
        time.sleep(0.05)
    assert loop.counters["generation_tokens"] >= 0 and loop.alive


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.skipif(structured_plugin is None, reason="features/structured_outputs is not installed")
def test_response_format_json_schema(client):
    import json
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    person = json.loads(got.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Some JSON."}], max_tokens=60, temperature=0,
        response_format={"type": "json_object"})
    assert isinstance(json.loads(got.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "bad"}})
    assert refused.value.body["param"] == "response_format"


def test_unsupported_fields_are_refused_not_ignored(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools,
                                       parallel_tool_calls=False)
    assert refused.value.body["param"] == "parallel_tool_calls"
    assert refused.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert refused.value.body["param"] == "suffix" and "fill-in-the-middle" in refused.value.body["message"]


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="import os", max_tokens=3, temperature=0)
    text = httpx.get(server[1] + "/metrics").text
    assert "# TYPE deepinfer_steps_total counter" in text and "deepinfer_running 0" in text
    assert "deepinfer_cuda_graph_captures_total 0" in text  # no CUDA graphs on a CPU
    assert "# TYPE deepinfer_kernel_compiles_total counter" in text
    finished = int(float(_sample(text, "deepinfer_finished_requests_total")))
    for histogram in ("time_to_first_token_seconds", "request_time_per_output_token_seconds",
                      "e2e_request_latency_seconds"):
        metric = f"deepinfer_{histogram}"
        assert f"# TYPE {metric} histogram" in text
        buckets = [int(n) for n in re.findall(rf'^{metric}_bucket{{le="[^"]+"}} (\d+)$', text, re.M)]
        count = int(_sample(text, f"{metric}_count"))
        assert buckets == sorted(buckets) and buckets[-1] == count >= 1 and float(_sample(text, f"{metric}_sum")) > 0
        # time per output token: the finished requests of two tokens or more (this one's three among them)
        assert count == finished if "per_output_token" not in histogram else count <= finished


def _sample(text: str, metric: str) -> str:
    return re.search(rf"^{metric} (\S+)$", text, re.M).group(1)


def test_api_key_and_queue_bound():
    loop, uv, thread, url = _serve(["--api-key", "sesame", "--max-queued", "1"])
    try:
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        headers = {"Authorization": "Bearer sesame"}
        body = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers) as first:
            assert first.status_code == 200
            second = httpx.post(url + "/v1/completions", json=body, headers=headers)
            assert second.status_code == 503 and second.json()["error"]["code"] == "server_overloaded"
        assert httpx.get(url + "/health").status_code == 200  # not behind the key
    finally:
        uv.should_exit = True
        thread.join()
        loop.stop()


def test_thinking_mode_returns_reasoning_content(client):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    args = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0, extra_body={"thinking": True})
    whole = client.chat.completions.create(**args).choices[0].message
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**args, stream=True) if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in chunks)
    assert reasoning == whole.reasoning_content and "</think>" not in reasoning
    assert "".join(d.content or "" for d in chunks) == whole.content


def test_a_stream_behind_by_several_steps_takes_every_waiting_delta_at_once():
    """A stream's deltas that queued while it was sending go out in one write: ``_Run.queued`` takes what waits
    (and only that), in order, counting the finished choice; an error the loop sent is raised in its turn."""
    from deepinfer.serve.app import _Run
    from deepinfer.serve.engine_loop import Delta
    from deepinfer.serve.errors import APIError

    async def scenario():
        events = asyncio.Queue()
        run = _Run([argparse.Namespace(params=SamplingParams(n=2))], events, prompt_tokens=3)
        for delta in (Delta(0, "a", 1), Delta(1, "b", 1), Delta(0, "c", 2, finish_reason="length")):
            events.put_nowait((0, delta))
        first = await run.next()
        rest = run.queued()
        assert [(choice, d.text) for choice, d in [first, *rest]] == [(0, "a"), (1, "b"), (0, "c")]
        assert run.queued() == [] and run.open == 1 and run.completion_tokens == 2
        events.put_nowait((0, APIError(500, "the engine failed")))
        with pytest.raises(APIError, match="the engine failed"):
            run.queued()

    asyncio.run(scenario())
