"""``deepinfer serve`` with its engine in a process of its own (``serve/engine_process.py``, the default): the same
answers as offline generate, streaming, refusals from the engine's checks, the queue bound, a client's disconnect
reaching the engine, and the server's side when that process fails."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.cli import serve as cli  # noqa: E402
from deepinfer.serve.engine_process import EngineProcess  # noqa: E402
from test_serve import _listen, _stop  # noqa: E402

MODEL = "deepinfer-tiny-v4.1"
PROMPTS = ["import os", "def fibonacci(n):", "class Stack:", "for i in range("]
BOUND = 4


def _build(*flags: str):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.build(parser.parse_args(["--model", MODEL, "--dtype", "float32", *flags]))


@pytest.fixture(scope="module")
def served():
    loop, app = _build("--max-queued", str(BOUND))
    assert isinstance(loop, EngineProcess)  # the default
    loop.start()
    server, thread, url = _listen(app)
    yield loop, url
    _stop(server, thread, loop)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, dtype="float32")


def test_answers_and_streams_equal_offline_generate(served, client, offline):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert got.choices[0].text == want[1].outputs[0].text and got.usage.completion_tokens == 16
    pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16,
                                                                     temperature=0, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == want[2].outputs[0].text
    steps = served[0].counters["steps"]

    async def one(c, prompt):
        return (await c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)).choices[0].text

    async def together():
        async with openai.AsyncOpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    assert asyncio.run(together()) == [o.outputs[0].text for o in want]
    # the counters came back from the engine's process; four requests of 16 tokens shared steps
    deadline = time.monotonic() + 10
    while served[0].counters["finished_requests"] < 1 + 1 + len(PROMPTS):
        assert time.monotonic() < deadline, served[0].counters
        time.sleep(0.02)
    assert served[0].counters["steps"] - steps < len(PROMPTS) * 16


def test_the_engine_s_checks_refuse_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, logit_bias={"999999": 1})
    assert refused.value.body["param"] == "logit_bias" and "outside the vocabulary" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[5] * 5000, max_tokens=4)
    assert refused.value.body["param"] == "prompt"


def test_past_the_bound_a_request_gets_503(served):
    async def stream(c):
        try:
            async with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    return r.status_code
                async for _ in r.aiter_lines():  # held open until every request was sent
                    if sent.is_set():
                        return 200
        except httpx.HTTPError as exc:
            return repr(exc)

    async def crowd():
        async with httpx.AsyncClient(base_url=served[1], timeout=60) as c:
            tasks = [asyncio.create_task(stream(c)) for _ in range(BOUND)]
            while served[0].counters["running"] + served[0].counters["waiting"] < BOUND:
                await asyncio.sleep(0.02)
            late = await stream(c)
            sent.set()
            return late, await asyncio.gather(*tasks)

    sent = asyncio.Event()
    late, admitted = asyncio.run(crowd())
    assert late == 503 and admitted == [200] * BOUND


def test_a_disconnect_aborts_in_the_engine_s_process(served):
    loop, url = served
    deadline = time.monotonic() + 20
    while loop.counters["running"] or loop.counters["waiting"]:  # the bound test's streams were aborted too
        assert time.monotonic() < deadline, loop.counters
        time.sleep(0.05)
    aborted = loop.counters["aborted_requests"]
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 500,
                                                              "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    while not (loop.counters["aborted_requests"] == aborted + 1 and loop.counters["running"] == 0):
        assert time.monotonic() < deadline + 20, loop.counters
        time.sleep(0.05)
    assert loop.alive


def test_a_failed_start_names_its_cause(tmp_path):
    loop, _ = _build("--model", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="the engine's process could not start: .*missing"):
        loop.start()
    assert not loop.alive


def test_when_the_engine_s_process_dies_clients_are_told(served):
    """Last in this module: it ends the module's engine."""
    loop, url = served
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000,
                                                              "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        loop._process.kill()
        rest = "\n".join(lines)
    assert "engine's process" in rest and '"type": "server_error"' in rest
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.APIStatusError) as refused:
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=2)
    assert refused.value.status_code == 503


def test_a_submission_to_a_process_gone_since_alive_was_read_is_a_503():
    import multiprocessing

    from deepinfer.serve.engine_loop import Submission
    from deepinfer.serve.errors import APIError

    loop = EngineProcess(MODEL, {}, max_queued=4)
    loop._pipe, theirs = multiprocessing.Pipe()
    theirs.close()  # the engine's end: gone
    loop._process = type("StillAlive", (), {"is_alive": lambda self: True})()
    submission = Submission("x", SamplingParams(max_tokens=1), events=None, loop=None)
    with pytest.raises(APIError) as refused:
        loop.submit(submission)
    assert refused.value.status == 503 and "has gone" in refused.value.message and not loop._open
    loop.abort(submission)  # nothing open: nothing sent, no error
