"""OpenAI's response shapes, built from the engine loop's ``Delta``\\ s: a whole response (``add`` then ``whole``)
or a stream of chunks (``opening`` then ``chunks``). Chat answers split into reasoning, content and tool calls."""

from __future__ import annotations

import time
import uuid

from deepinfer.chat_encoding import END_THINK
from deepinfer.outputs import Logprob
from deepinfer.serve.engine_loop import Delta
from deepinfer.serve.tool_calls import call_errors, held_back, parse_tool_calls


def usage(run) -> dict:
    return {"prompt_tokens": run.prompt_tokens, "completion_tokens": run.completion_tokens,
            "total_tokens": run.prompt_tokens + run.completion_tokens}


def _finish_reason(reason: str | None) -> str | None:
    return reason  # the engine's "stop" and "length" are OpenAI's; "abort" never reaches a connected client


def _ranked(entries: dict[int, Logprob]) -> list[Logprob]:
    """The top alternatives, most likely first: the entries with a rank (the sampled token may have none, being
    outside the top k, and is then reported only as the token itself)."""
    return sorted((e for e in entries.values() if e.rank is not None), key=lambda e: e.rank)


class _Response:
    object: str
    prefix: str

    def __init__(self, body, model: str, run):
        self.model, self.created = model, int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self.choices = len(run.submissions) * run.n
        self.finish = [None] * self.choices
        self.text = [""] * self.choices
        self.logprobs = None if body.num_logprobs() is None else [[] for _ in range(self.choices)]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": f"{self.object}.chunk" if self.object == "chat.completion" else self.object,
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = usage
        return out

    def opening(self) -> list[dict]:
        return []

    def add(self, choice: int, delta: Delta) -> None:
        self.text[choice] += delta.text
        self.finish[choice] = _finish_reason(delta.finish_reason)
        if self.logprobs is not None and delta.logprobs:
            self.logprobs[choice] += delta.logprobs


class Completion(_Response):
    object, prefix = "text_completion", "cmpl"

    def __init__(self, body, model, run, echoes: list[str] | None = None):
        super().__init__(body, model, run)
        self.offset = [0] * self.choices  # text_offset of the next token, for streams
        # per choice, the prompt text still to lead its text (echo); a prompt's n choices follow one another
        self.unechoed = [echoes[i // run.n] if echoes else "" for i in range(self.choices)]

    def _echoed(self, choice: int, text: str) -> str:
        """``text`` led by the choice's prompt the first time (echo), as is after."""
        text, self.unechoed[choice] = self.unechoed[choice] + text, ""
        return text

    def _logprobs(self, choice: int, tokens: list[tuple[int, dict[int, Logprob]]] | None) -> dict | None:
        """The legacy shape: parallel lists of tokens, their logprobs, top alternatives and character offsets."""
        if self.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entries in tokens or ():
            sampled = entries[token]
            out["tokens"].append(sampled.decoded_token)
            out["token_logprobs"].append(sampled.logprob)
            out["top_logprobs"].append({e.decoded_token: e.logprob for e in _ranked(entries)})
            out["text_offset"].append(self.offset[choice])
            self.offset[choice] += len(sampled.decoded_token)
        return out

    def whole(self, run) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": i, "text": self._echoed(i, self.text[i]),
                             "logprobs": self._logprobs(i, self.logprobs[i] if self.logprobs else None),
                             "finish_reason": self.finish[i]} for i in range(self.choices)], "usage": usage(run)}

    def chunks(self, choice: int, delta: Delta) -> list[dict]:
        return [self.chunk([{"index": choice, "text": self._echoed(choice, delta.text),
                             "logprobs": self._logprobs(choice, delta.logprobs),
                             "finish_reason": _finish_reason(delta.finish_reason)}])]


def _chat_logprobs(tokens: list[tuple[int, dict[int, Logprob]]]) -> list[dict]:
    def one(e: Logprob) -> dict:
        return {"token": e.decoded_token, "logprob": e.logprob, "bytes": list(e.decoded_token.encode("utf-8"))}

    return [{**one(entries[token]), "top_logprobs": [one(e) for e in _ranked(entries)]} for token, entries in tokens]


class Chat(_Response):
    """In thinking mode the output is "reasoning</think>answer": the reasoning goes out as ``reasoning_content``.
    With tools, a DSML block at the answer's end becomes ``tool_calls`` (``tool_calls.py``); what is wrong with
    the calls (``call_errors``) goes out as the message's ``tool_call_errors``, a field OpenAI does not have."""

    object, prefix = "chat.completion", "chatcmpl"

    def __init__(self, body, model, run, tools: list[dict] | None):
        super().__init__(body, model, run)
        self.thinking, self.tools = body.thinking, tools
        self.sent = [(0, 0)] * self.choices  # (reasoning, content) characters streamed so far

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        reasoning, end, content = text.partition(END_THINK)
        if end or finished:
            return reasoning, content
        # a tail that may still become </think> is held back
        for keep in range(len(END_THINK) - 1, 0, -1):
            if reasoning.endswith(END_THINK[:keep]):
                return reasoning[:-keep], ""
        return reasoning, ""

    def _answer(self, text: str, finished: bool) -> tuple[str, str, list, list]:
        """(reasoning, content, tool calls, their errors) of a choice's text so far; unfinished, content stops where
        a tool-call block may be starting, parsed once the choice ends (so a stream ends as the whole response
        does)."""
        reasoning, content = self._split(text, finished)
        if not self.tools:
            return reasoning, content, [], []
        if finished:
            content, calls = parse_tool_calls(content)
            return reasoning, content, calls, call_errors(content, calls, self.tools)
        return reasoning, content[:held_back(content)], [], []

    def _message(self, reasoning: str, content: str, calls: list, errors: list) -> dict:
        message = {"role": "assistant", "content": content if content or not calls else None}
        if self.thinking:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        if errors:
            message["tool_call_errors"] = errors
        return message

    def _finish(self, reason: str | None, calls: list) -> str | None:
        return "tool_calls" if calls and reason is not None else _finish_reason(reason)

    def whole(self, run) -> dict:
        choices = []
        for i in range(self.choices):
            reasoning, content, calls, errors = self._answer(self.text[i], True)
            choices.append({"index": i, "message": self._message(reasoning, content, calls, errors),
                            "logprobs": None if self.logprobs is None else {"content": _chat_logprobs(self.logprobs[i])},
                            "finish_reason": self._finish(self.finish[i], calls)})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(run)}

    def opening(self) -> list[dict]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.choices)]

    def chunks(self, choice: int, delta: Delta) -> list[dict]:
        self.text[choice] += delta.text
        finished = delta.finish_reason is not None
        reasoning, content, calls, errors = self._answer(self.text[choice], finished)
        sent_reasoning, sent_content = self.sent[choice]
        self.sent[choice] = (len(reasoning), len(content))
        piece = {}
        if len(reasoning) > sent_reasoning:
            piece["reasoning_content"] = reasoning[sent_reasoning:]
        if len(content) > sent_content:
            piece["content"] = content[sent_content:]
        if calls:  # each call whole, in one delta: OpenAI's clients join a call's pieces by its index
            piece["tool_calls"] = [call.openai(index=k) for k, call in enumerate(calls)]
        if errors:
            piece["tool_call_errors"] = errors
        logprobs = None if self.logprobs is None else {"content": _chat_logprobs(delta.logprobs or [])}
        if not piece and not finished and not (logprobs and logprobs["content"]):
            return []
        return [self.chunk([{"index": choice, "delta": piece, "logprobs": logprobs,
                             "finish_reason": self._finish(delta.finish_reason, calls)}])]
