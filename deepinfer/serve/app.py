"""The HTTP routes: OpenAI's completions, chat completions (streamed as server-sent events with ``stream: true``),
models, plus /health and /metrics. Every request becomes ``Submission``\\ s of the one ``EngineLoop``."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from deepinfer.chat_encoding import encode_chat
from deepinfer.serve.engine_loop import Admitted, Delta, EngineLoop, Submission
from deepinfer.serve.errors import APIError, invalid
from deepinfer.serve.protocol import ChatRequest, CompletionRequest
from deepinfer.serve.responses import Chat, Completion, usage

_DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="deepinfer serve")
    app.state.engine_loop = loop

    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is a character position, not a field
            error = (first.get("ctx") or {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON: {error}".rstrip(": ")).response()
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        # pydantic tries each member of a union: the loc's last part may name the member's type, not a field
        param = ".".join(p for p in where if not p.startswith(("list[", "str", "int", "float", "dict["))) or None
        return invalid(f"{param or 'body'}: {first.get('msg')}", param).response()

    if api_key is not None:
        app.add_middleware(_APIKey, key=api_key)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse(status_code=503, content={"status": "engine stopped", "error": repr(loop.error)})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "deepinfer", "max_model_len": loop.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(loop.counters), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        _check_model(body.model, model_name)
        prompts = body.prompts()
        params = body.sampling_params(16 if body.max_tokens is None else body.max_tokens)
        events: asyncio.Queue = asyncio.Queue()
        submissions = [Submission(p, params, name=f"prompt[{i}]" if len(prompts) > 1 else "prompt", index=i,
                                  events=events) for i, p in enumerate(prompts)]
        run = await _start(loop, submissions, events)
        # echo: each prompt's text leads its choices' text (token-id prompts decoded, special tokens kept)
        echoes = [p if isinstance(p, str) else loop.tokenizer.decode(p) for p in prompts] if body.echo else None
        response = Completion(body, model_name, run, echoes)
        return _stream(response, run, loop) if body.stream else await _collect(response, run, loop, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        _check_model(body.model, model_name)
        tools = body.tool_definitions()
        messages, images = body.conversation()
        try:
            text = encode_chat(messages, body.thinking, tools=tools, reasoning_effort=body.reasoning_effort)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        so_args, constrained_by = body.constraint(tools)
        limit = body.completion_limit()
        params = body.sampling_params(1 if limit is None else limit, so_args)
        events: asyncio.Queue = asyncio.Queue()
        run = await _start(loop, [Submission(text, params, fill_max_tokens=limit is None, name="messages",
                                             add_special_tokens=False, constrained_by=constrained_by, images=images,
                                             events=events)], events)
        response = Chat(body, model_name, run, tools=tools)
        return _stream(response, run, loop) if body.stream else await _collect(response, run, loop, http)

    return app


class _APIKey:
    """Requests to /v1/* need ``Authorization: Bearer KEY``. A plain ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` wraps ``receive`` so that a handler no longer sees its client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                    type="authentication_error", code="invalid_api_key").response()
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise APIError(404, f"the model {asked!r} is not served here; this server serves {served!r}", "model",
                       code="model_not_found")


class _Run:
    """An HTTP request's submissions once the engine loop admitted them all."""

    def __init__(self, submissions: list[Submission], events: asyncio.Queue, prompt_tokens: int):
        self.submissions, self.events, self.prompt_tokens = submissions, events, prompt_tokens
        self.n = submissions[0].params.n
        self.open = len(submissions) * self.n  # choices still generating
        self.completion_tokens = 0

    async def next(self) -> tuple[int, Delta]:
        """The next delta as (choice index, delta); an ``APIError`` the loop sent is raised."""
        return self._take(*await self.events.get())

    def queued(self) -> list[tuple[int, Delta]]:
        """The deltas already waiting, without waiting for more (a stream that fell behind sends them at once)."""
        taken = []
        while self.open and not self.events.empty():
            taken.append(self._take(*self.events.get_nowait()))
        return taken

    def _take(self, index: int, event) -> tuple[int, Delta]:
        if isinstance(event, APIError):
            raise event
        if event.finish_reason is not None:
            self.open -= 1
            self.completion_tokens += event.num_tokens
        return index * self.n + event.index, event


async def _start(loop: EngineLoop, submissions: list[Submission], events: asyncio.Queue) -> _Run:
    """Submits every prompt and waits for each to be admitted; one refused (a 400) withdraws the others."""
    started, error, prompt_tokens = [], None, 0
    try:
        for submission in submissions:
            loop.submit(submission)
            started.append(submission)
        for _ in started:
            _, event = await events.get()
            if isinstance(event, APIError):
                error = error or event
            elif isinstance(event, Admitted):
                prompt_tokens += event.num_prompt_tokens
        if error is not None:
            raise error
    except BaseException:  # a refusal, a failure, or the client gone (CancelledError): withdraw, then re-raise
        for submission in started:
            loop.abort(submission)
        raise
    return _Run(submissions, events, prompt_tokens)


async def _collect(response, run: _Run, loop: EngineLoop, http: HTTPRequest) -> dict:
    # checked by the clock, not only when no delta came for a while: a busy engine sends one every step
    checked = time.monotonic()
    try:
        while run.open:
            try:
                choice, delta = await asyncio.wait_for(run.next(), _DISCONNECT_POLL_S)
                response.add(choice, delta)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked >= _DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await http.is_disconnected():
                    raise asyncio.CancelledError
    except BaseException:  # the client gone (CancelledError) or a failure: the engine must not keep generating
        for submission in run.submissions:
            loop.abort(submission)
        raise
    return response.whole(run)


def _stream(response, run: _Run, loop: EngineLoop) -> StreamingResponse:
    async def events():
        try:
            for chunk in response.opening():
                yield _sse(chunk)
            while run.open:
                # one write for every delta that is waiting: a client behind by several steps costs one send
                deltas = [await run.next()] + run.queued()
                payload = "".join(_sse(chunk) for choice, delta in deltas for chunk in response.chunks(choice, delta))
                if payload:
                    yield payload
            if response.include_usage:
                yield _sse(response.chunk([], usage=usage(run)))
            yield "data: [DONE]\n\n"
        except APIError as exc:  # the engine failed after the headers went out: OpenAI's clients read this
            yield _sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})
        finally:
            if run.open:  # the client went away (or the engine failed): its samples end, their blocks are freed
                for submission in run.submissions:
                    loop.abort(submission)

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _prometheus(counters: dict) -> str:
    """The engine's counters in Prometheus' text format: totals as counters, request latencies as histograms, the
    rest as gauges."""
    totals = {"steps", "prompt_tokens", "cached_prompt_tokens", "generation_tokens", "finished_requests",
              "aborted_requests", "preemptions", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
              "cuda_graph_captures", "kernel_compiles"}
    lines = []
    for name, value in counters.items():
        if name == "histograms":
            for histogram, data in value.items():
                metric = f"deepinfer_{histogram}"
                lines.append(f"# TYPE {metric} histogram")
                lines += [f'{metric}_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}} {count}'
                          for bound, count in zip(data["le"], data["counts"])]
                lines += [f"{metric}_sum {data['sum']}", f"{metric}_count {data['count']}"]
            continue
        if isinstance(value, dict):
            metric = f"deepinfer_{name}"
            lines += [f"# TYPE {metric} gauge"] + [f'{metric}{{kind="{k}"}} {v}' for k, v in value.items()]
            continue
        metric = f"deepinfer_{name}_total" if name in totals else f"deepinfer_{name}"
        lines += [f"# TYPE {metric} {'counter' if name in totals else 'gauge'}", f"{metric} {value}"]
    return "\n".join(lines) + "\n"
