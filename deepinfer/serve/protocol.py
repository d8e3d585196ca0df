"""The request bodies the server takes (pydantic: an unknown field is refused, naming it) and how each maps to
``SamplingParams``. Responses are plain dicts in OpenAI's shapes, built in ``app``."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from deepinfer.chat_encoding import split_content_images
from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.errors import invalid, unsupported
from deepinfer.serve.tool_grammar import ToolSchemaError, forced_call_grammar

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

    def _check_combinations(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")

    def sampling_params(self, max_tokens: int, so_args: dict | None = None) -> SamplingParams:
        """``SamplingParams``' own checks name the field refused (temperature=-1: a 400 naming temperature)."""
        self._check_combinations()
        given = dict(logprobs=self.num_logprobs(), n=self.n, temperature=self.temperature, top_p=self.top_p,
                     stop=self.stop, seq_seed=self.seed, logit_bias=self._logit_bias(),
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

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's map of token ids as text to biases, keyed by int (``SamplingParams`` checks the values)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for token_id, value in self.logit_bias.items():
            try:
                bias[int(token_id)] = value
            except ValueError:
                raise invalid(f"logit_bias keys must be token ids (integers as text), got {token_id!r}",
                              "logit_bias") from None
        return bias

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
        if self.echo and self.logprobs is not None:
            raise invalid("echo cannot be combined with logprobs: the engine computes no log-probabilities of the "
                          "prompt's tokens, which OpenAI's echo returns with them; ask without echo", "echo")
        if self.suffix is not None:
            raise invalid("suffix (fill-in-the-middle) is not supported: DeepSeek-V4 has no fill-in-the-middle "
                          "encoding here, so the model cannot write text that ends in suffix", "suffix")
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
        self._forced_tool()  # a bad tool_choice is refused before anything runs
        return self.tools

    def _forced_tool(self) -> tuple[bool, str | None]:
        """(whether tool_choice forces a call, the one tool it names or None for any): "required" or
        ``{"type": "function", "function": {"name": ...}}``; "auto" and None leave it to the model."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return False, None
        if choice == "required":
            return True, None
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise invalid('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                          f'{{"name": ...}}}}, got {json.dumps(choice)}', "tool_choice")
        if name not in [tool["function"]["name"] for tool in self.tools]:
            raise invalid(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return True, name

    def constraint(self, tools: list[dict] | None) -> tuple[dict | None, str]:
        """``so_args`` for the output and the field they come from (the engine's refusals name it): a forced tool
        call's DSML grammar (``tool_grammar``), ``response_format``'s schema, or none."""
        forced, name = self._forced_tool() if tools is not None else (False, None)
        if not forced:
            so_args = self.response_format.so_args() if self.response_format is not None else None
            return so_args, "response_format"
        if self.response_format is not None and self.response_format.type != "text":
            raise invalid("response_format cannot be combined with a tool_choice that forces a call: the answer is "
                          "the call", "response_format")
        try:
            grammar = forced_call_grammar(tools, name, self.thinking)
        except ToolSchemaError as exc:
            raise invalid(str(exc), exc.where) from None
        return {"schema_type": "ebnf", "schema": grammar}, "tool_choice"

    def conversation(self) -> tuple[list[dict], list]:
        """The messages with OpenAI's content parts rendered as ``LLM.chat`` renders them (text parts joined by a
        blank line, each image part a placeholder), and the images in prompt order."""
        for i, message in enumerate(self.messages):
            if not isinstance(message, dict):
                raise invalid(f"messages[{i}] must be an object", f"messages[{i}]")
        try:
            return split_content_images(self.messages)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None

    def completion_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise invalid("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
