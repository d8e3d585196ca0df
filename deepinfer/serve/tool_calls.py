"""The inverse of ``chat_encoding._dsml``: the model's DSML tool-call block parsed back into OpenAI ``tool_calls``.

A DeepSeek-V4 answer that calls tools ends with::

    answer text
    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``parse_tool_calls`` splits such a text into the content before the block and the calls. Anything that is not a
well-formed block (an unclosed tag, a stray character between tags, a ``string="false"`` value that is not JSON, a
repeated parameter) is returned whole as content: what the model wrote reaches the client either way.
``call_errors`` says what is wrong with the calls of a choice (a block that did not parse, a tool that is not in
``tools``, arguments that break the tool's ``parameters`` schema): the server reports it next to what the model
wrote, which it returns unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from deepinfer.chat_encoding import DSML, TOOL_CALLS_END_TAG, TOOL_CALLS_TAG

_INVOKE = re.compile(rf'\s*<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI's function.arguments
    id: str = ""

    def __post_init__(self):
        # OpenAI's ids are opaque strings the client echoes back as tool_call_id; random, as theirs
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        """The call as OpenAI's ``tool_calls[]`` entry; ``index`` set: as a streamed delta's entry."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)``; ``calls`` is empty (and ``content`` is ``text``) unless ``text`` holds one well-formed
    DSML block. Text after the block's end is kept, appended to the content."""
    start = text.find(TOOL_CALLS_TAG)
    if start < 0:
        return text, []
    end = text.find(TOOL_CALLS_END_TAG, start)
    if end < 0:
        return text, []
    calls = _invokes(text[start + len(TOOL_CALLS_TAG):end])
    if not calls:
        return text, []
    # the encoder puts a blank line before the block: it belongs to the format, not to the answer
    content = text[:start].rstrip("\n") + text[end + len(TOOL_CALLS_END_TAG):]
    return content, calls


def _invokes(body: str) -> list[ToolCall] | None:
    calls, position = [], 0
    while True:
        match = _INVOKE.match(body, position)
        if match is None:
            break
        arguments = _parameters(match.group(2))
        if arguments is None or not match.group(1):
            return None
        calls.append(ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False)))
        position = match.end()
    if body[position:].strip():  # something between or after the invokes that is not one
        return None
    return calls


def _parameters(body: str) -> dict | None:
    arguments, position = {}, 0
    while True:
        match = _PARAMETER.match(body, position)
        if match is None:
            break
        name, is_string, value = match.groups()
        if name in arguments:
            return None
        if is_string == "true":
            arguments[name] = value
        else:
            try:
                arguments[name] = json.loads(value)
            except json.JSONDecodeError:
                return None
        position = match.end()
    if body[position:].strip():
        return None
    return arguments


def held_back(text: str) -> int:
    """Where a stream must stop sending content: the start of a DSML block, or of a tail that may still grow into
    one (``len(text)`` when neither). What follows is parsed once the sample ends."""
    cut = text.find(TOOL_CALLS_TAG)
    if cut < 0:
        cut = len(text)
        for keep in range(min(len(TOOL_CALLS_TAG) - 1, len(text)), 0, -1):
            if text.endswith(TOOL_CALLS_TAG[:keep]):
                cut -= keep
                break
    # the newlines before a block are dropped with it (parse_tool_calls): they wait until it is known not to come
    return len(text[:cut].rstrip("\n"))


def call_errors(content: str, calls: list[ToolCall], tools: list[dict]) -> list[dict]:
    """``[{"index", "id", "name", "message"}]`` for each call the client should not run as is, and one entry
    without index, id or name for a block left in ``content`` because it did not parse (or was cut short)."""
    if not calls:
        if TOOL_CALLS_TAG not in content:
            return []
        return [{"message": "the answer holds a DSML tool-call block that does not parse (malformed, or cut short "
                            "by max_tokens): it is returned as content, not as tool_calls"}]
    schemas = {tool["function"]["name"]: tool["function"].get("parameters") for tool in tools}
    errors = []
    for index, call in enumerate(calls):
        if call.name not in schemas:
            problem = f"the model called {call.name!r}, which is not in tools"
        else:
            problem = _schema_problem(json.loads(call.arguments), schemas[call.name])
        if problem is not None:
            errors.append({"index": index, "id": call.id, "name": call.name, "message": problem})
    return errors


def _schema_problem(arguments: dict, schema: dict | None) -> str | None:
    if not schema:
        return None
    try:
        import jsonschema
    except ImportError:
        return "arguments not checked against the tool's parameters schema: jsonschema is not installed"
    validator = jsonschema.validators.validator_for(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        return f"arguments not checked: the tool's parameters are not a valid JSON schema ({exc.message})"
    error = jsonschema.exceptions.best_match(validator(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"arguments{where} break the tool's parameters schema: {error.message}"
