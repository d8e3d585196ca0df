"""The request bodies the server takes (pydantic: an unknown field is refused, naming it) and how each maps to
``SamplingParams``. Responses are plain dicts in OpenAI's shapes, built in ``app``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.errors import invalid, unsupported

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs, for completions' logprobs too


class _Body(BaseModel):
    # nothing a client sends is dropped: a field this server does not know is a 400 naming it
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """The fields both endpoints share; the last group is vLLM's extensions (``extra_body`` in the openai client)."""

    model: str
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    min_tokens: StrictInt | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None

    def _refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise unsupported("logit_bias", "the engine's sampler has no per-token bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")

    def sampling_params(self, max_tokens: int, so_args: dict | None = None) -> SamplingParams:
        """``SamplingParams``' own checks name the field refused (temperature=-1: a 400 naming temperature)."""
        self._refuse_unsupported()
        given = dict(logprobs=self.num_logprobs(), n=self.n, temperature=self.temperature, top_p=self.top_p,
                     stop=self.stop, seq_seed=self.seed,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens,
                     repetition_penalty=self.repetition_penalty, stop_token_ids=self.stop_token_ids,
                     ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                     include_stop_str_in_output=self.include_stop_str_in_output)
        try:
            return SamplingParams(max_tokens=max_tokens, so_args=so_args,
                                  **{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:
            raise invalid(str(exc)) from None

    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: how many top alternatives each token reports (None: no logprobs)."""
        raise NotImplementedError


def _check_top(value: int, field: str) -> int:
    # the engine could return the whole vocabulary (-1); an HTTP response of that size is a mistake, as OpenAI's cap
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"{field} must be between 0 and {MAX_LOGPROBS}, got {value}", field)
    return value


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # the legacy API: how many top alternatives per token
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise unsupported("echo")
        if self.suffix:
            raise unsupported("suffix", "DeepSeek-V4 has no fill-in-the-middle encoding here")
        if self.best_of not in (None, 1, self.n):
            raise unsupported("best_of", "only best_of == n")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return list(prompt)

    def num_logprobs(self) -> int | None:
        return None if self.logprobs is None else _check_top(self.logprobs, "logprobs")


class JsonSchema(_Body):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def so_args(self) -> dict | None:
        """OpenAI's response formats as the structured-outputs plugin's ``so_args``."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"schema_type": "json", "schema": {"type": "object"}}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise invalid("response_format of type json_schema needs json_schema.schema", "response_format")
        return {"schema_type": "json", "schema": self.json_schema.schema_}


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Literal["high", "max"] | None = None
    # DeepSeek's thinking mode: the answer opens with <think>; its reasoning comes back as reasoning_content
    thinking: StrictBool = False

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else _check_top(self.top_logprobs, "top_logprobs")

    def tool_definitions(self) -> list[dict] | None:
        """The tools to render in the prompt and parse calls for, or None (none given, or ``tool_choice: "none"``,
        which OpenAI defines as "the model calls no tool": it is not shown any)."""
        choice = self.tool_choice
        if choice is not None and not self.tools and choice != "none":
            raise invalid("tool_choice needs tools", "tool_choice")
        if choice not in (None, "auto", "none"):
            if choice == "required" or isinstance(choice, dict):
                # forcing a call would need a grammar of the DSML block for each tool's schema: not built yet
                raise unsupported("tool_choice", f"only \"auto\" and \"none\", got {json.dumps(choice)}")
            raise invalid(f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r}',
                          "tool_choice")
        if self.parallel_tool_calls is False:
            # the model may still write several calls; keeping only the first would drop what it wrote
            raise unsupported("parallel_tool_calls", "the model's calls cannot be limited to one")
        if not self.tools or choice == "none":
            return None
        for i, tool in enumerate(self.tools):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise invalid(f'tools[{i}] must be {{"type": "function", "function": {{"name": str, ...}}}}',
                              f"tools[{i}]")
        return self.tools

    def conversation(self) -> list[dict]:
        """The messages, with OpenAI's content parts joined into text (only text parts exist for this model)."""
        messages = []
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict):
                raise invalid(f"messages[{i}] must be an object", f"messages[{i}]")
            content = message.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise invalid(f"messages[{i}].content[{j}]: only text parts are supported (DeepSeek-V4 "
                                      "takes no images here)", f"messages[{i}].content[{j}]")
                    texts.append(part["text"])
                message = {**message, "content": "".join(texts)}
            messages.append(message)
        return messages

    def completion_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise invalid("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
