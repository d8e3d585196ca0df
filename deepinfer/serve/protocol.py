"""The request bodies the server takes (pydantic: an unknown field is refused, naming it) and how each maps to
``SamplingParams``. Responses are plain dicts in OpenAI's shapes, built in ``app``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from deepinfer.sampling_params import SamplingParams
from deepinfer.serve.errors import invalid, unsupported


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
    logprobs: Any = None
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
        if self.logprobs not in (None, False):
            raise unsupported("logprobs")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed with stream: true", "stream_options")

    def sampling_params(self, max_tokens: int, so_args: dict | None = None) -> SamplingParams:
        """``SamplingParams``' own checks name the field refused (temperature=-1: a 400 naming temperature)."""
        self._refuse_unsupported()
        given = dict(n=self.n, temperature=self.temperature, top_p=self.top_p, stop=self.stop, seq_seed=self.seed,
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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
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
    max_completion_tokens: StrictInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Literal["high", "max"] | None = None
    # DeepSeek's thinking mode: the answer opens with <think>; its reasoning comes back as reasoning_content
    thinking: StrictBool = False

    def conversation(self) -> list[dict]:
        """The messages, with OpenAI's content parts joined into text (only text parts exist for this model)."""
        if self.tools or self.tool_choice not in (None, "none") or self.parallel_tool_calls is not None:
            field = "tools" if self.tools else "tool_choice" if self.tool_choice not in (None, "none") \
                else "parallel_tool_calls"
            raise unsupported(field, "tool calls are not parsed from the model's DSML output yet")
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
