"""DeepSeek-V4's chat encoding: a conversation to the prompt text the model was trained on.

``encode_chat`` gives the same text, byte for byte, as ``encode_messages`` in DeepSeek's release file
``encoding/encoding_dsv4.py`` (its defaults: ``drop_thinking=True``, a BOS, no context) for what is here: system,
user, assistant (``content``, ``reasoning_content``, OpenAI-shaped ``tool_calls``), tool and developer messages,
OpenAI-shaped tool definitions, chat and thinking modes and ``reasoning_effort``. The format::

    BOS [effort prefix] system [\\n\\n## Tools ...] <｜User｜>question<｜Assistant｜></think>answer EOS
    <｜User｜>question<｜Assistant｜></think>              (chat mode: the model answers directly)
    <｜User｜>question<｜Assistant｜><think>               (thinking mode: the model reasons first)

- Earlier assistant turns are ``</think>answer EOS``: their reasoning is not replayed, except in thinking mode
  with tools defined, where every turn keeps ``<think>reasoning</think>``.
- Tool calls follow the answer as a DSML block: ``\\n\\n<｜DSML｜tool_calls>`` of ``<｜DSML｜invoke name="f">``
  with one ``<｜DSML｜parameter name="k" string="true|false">`` per argument (a string as is, anything else as JSON).
- Tool results are user turns, ``<tool_result>...</tool_result>``, ordered as the calls were; consecutive user and
  tool messages form one user turn, their parts joined by a blank line.
- ``reasoning_effort="max"`` in thinking mode puts a fixed instruction right after BOS; ``"high"`` and ``None``
  add nothing (the release accepts only these three; a later revision seen in forks gives "high" this instruction
  and "max" a stronger one: not followed here).
- Arguments given as a dict are taken as the JSON object they are (the release expects JSON text).
- A developer message is a user turn the release's search agent uses; in thinking mode without tools, developer
  messages before the last user turn are left out.
- Content given as OpenAI content parts (``split_content_images``): text parts as they are, each image part the
  image placeholder ``<｜deepseek_image｜>``, parts joined by a blank line (as NeMo AutoModel's V4.1 processor
  renders them).
Not covered: ``response_format``, ``latest_reminder``, quick-instruction ``task`` tokens, ``wo_eos`` prefills and
decoding the model's output.
"""

from __future__ import annotations

import json

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
ROLES = ("system", "developer", "user", "tool", "assistant")
ASKING = ("developer", "user", "tool")  # roles the assistant answers
EFFORTS = (None, "high", "max")

MAX_EFFORT = (  # the release's fixed text for reasoning_effort="max"
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside \
{THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"


def split_content_images(messages: list[dict]) -> tuple[list[dict], list]:
    """Messages whose ``content`` may be a list of OpenAI content parts (``{"type": "text", "text": ...}``,
    ``{"type": "image_url", "image_url": {"url": ...}}``, ``{"type": "image", "image": ...}``) -> (the messages
    with str content, each image a placeholder, and the images in prompt order: URLs, paths, bytes or PIL images,
    as given). A placeholder written in text is refused: images must be parts of their own."""
    converted, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            raise ValueError(f"messages[{i}]: {IMAGE_PLACEHOLDER} in text; give images as content parts")
        if not isinstance(content, list):
            converted.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                if IMAGE_PLACEHOLDER in part["text"]:
                    raise ValueError(f"messages[{i}].content[{j}]: {IMAGE_PLACEHOLDER} in text; give images as "
                                     "content parts")
                texts.append(part["text"])
            elif kind in ("image_url", "image") and part.get(kind) is not None:
                source = part[kind]
                images.append(source["url"] if isinstance(source, dict) and "url" in source else source)
                texts.append(IMAGE_PLACEHOLDER)
            else:
                raise ValueError(f'messages[{i}].content[{j}] must be {{"type": "text", "text": str}} or '
                                 f'{{"type": "image_url", "image_url": {{"url": ...}}}}; got {part!r:.80}')
        converted.append({**message, "content": "\n\n".join(texts)})
    return converted, images


def encode_chat(messages: list[dict], thinking: bool = False, tools: list[dict] | None = None,
                reasoning_effort: str | None = None) -> str:
    """The prompt for the assistant's next turn. ``messages``: dicts with a ``role`` (system, developer, user, tool,
    assistant) and a str ``content`` (an assistant's may be None); an assistant message may add ``reasoning_content``
    and ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments"}}]``, arguments a JSON object
    as text or a dict), a tool message ``tool_call_id``. System messages come first, an assistant message answers a
    user, tool or developer message, and the last message is one of those. ``tools``: OpenAI-shaped definitions
    (``[{"type": "function", "function": {"name", "description", "parameters"}}]``), rendered after the first
    system message's content (an empty one is added if there is none). ``thinking``: the model reasons in
    ``<think>`` before answering. ``reasoning_effort``: None, "high" or "max". Raises ValueError naming the first
    message that breaks these rules."""
    if reasoning_effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {EFFORTS}, got {reasoning_effort!r}")
    _check(messages)
    schemas = _schemas(tools) if tools else None
    keep_reasoning = thinking and schemas is not None  # the release keeps every turn's reasoning once tools exist
    turns = _turns(messages)
    if thinking and not keep_reasoning:  # developer turns before the last user turn are left out
        last = len(turns) - 1
        turns = [t for i, t in enumerate(turns) if t["role"] != "developer" or i == last]
    parts = [BOS, MAX_EFFORT if thinking and reasoning_effort == "max" else ""]
    if schemas is not None and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": ""})
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            parts.append(turn["content"] or "")
            if i == 0 and schemas is not None:
                parts.append("\n\n" + TOOLS_SECTION.replace("{schemas}", schemas))
            continue
        if role == "assistant":
            if keep_reasoning:
                parts += [turn.get("reasoning_content") or "", END_THINK]
            parts += [turn.get("content") or "", _dsml(turn.get("tool_calls")), EOS]
            continue
        parts += [USER, turn["content"]]
        final = i == len(turns) - 1
        if final or turns[i + 1]["role"] == "assistant":
            parts += [ASSISTANT, THINK if thinking and (keep_reasoning or final) else END_THINK]
    return "".join(parts)


def _check(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("a chat needs a list of at least one message")
    previous = None
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if "tools" in message:
            raise ValueError(f"{where}: pass tool definitions as tools=[...], not in a message")
        if not isinstance(content, str) and not (role == "assistant" and content is None):
            raise ValueError(f"{where}: a {role} message's content must be a str, got {type(content).__name__}")
        if role == "developer" and not content:
            raise ValueError(f"{where}: a developer message must not be empty")
        if role == "system" and previous not in (None, "system"):
            raise ValueError(f"{where}: system messages must come before the others")
        if role == "assistant":
            if previous not in ASKING:
                raise ValueError(f"{where}: an assistant message must follow a user, tool or developer message")
            if not isinstance(message.get("reasoning_content") or "", str):
                raise ValueError(f"{where}: reasoning_content must be a str")
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ValueError(f"{where}: tool_calls must be a list")
            for j, call in enumerate(calls):
                _arguments(call, f"{where}.tool_calls[{j}]")
        previous = role
    if previous not in ASKING:
        raise ValueError("the last message must be a user, tool or developer message: the model answers it")


def _turns(messages: list[dict]) -> list[dict]:
    """The messages with each run of user and tool messages made one user turn, its tool results in call order."""
    turns, parts, call_order = [], [], {}

    def close_user_turn():
        results = sorted((p for p in parts if p[0]), key=lambda p: call_order.get(p[1], 0))
        if len(results) > 1 and call_order:  # results take the calls' order, other parts keep their places
            slots = iter(results)
            parts[:] = [next(slots) if p[0] else p for p in parts]
        turns.append({"role": "user", "content": "\n\n".join(text for _, _, text in parts)})
        parts.clear()

    for message in messages:
        role = message["role"]
        if role in ("user", "tool"):  # (is a tool result, its call's id, text)
            is_result = role == "tool"
            text = f"<tool_result>{message['content']}</tool_result>" if is_result else message["content"]
            parts.append((is_result, message.get("tool_call_id", ""), text))
            continue
        if parts:
            close_user_turn()
        if role == "assistant" and message.get("tool_calls"):
            ids = (call.get("id") or call["function"].get("id") for call in message["tool_calls"])
            call_order = {call_id: j for j, call_id in enumerate(ids) if call_id}
        turns.append(message)
    if parts:
        close_user_turn()
    return turns


def _schemas(tools) -> str:
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        raise ValueError('tools must be a list of {"type": "function", "function": {...}} definitions')
    return "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)


def _arguments(call, where: str) -> dict:
    """A tool call's arguments as a dict (text that is not JSON becomes one string argument, "arguments")."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{"name": str, "arguments": ...}}}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {"arguments": arguments}
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}: arguments must be a JSON object (as text or a dict), got {arguments!r}")
    return arguments


# The tool-call block's tags, as the encoder writes them: the server parses them (serve/tool_calls.py) and forces
# them by a grammar (serve/tool_grammar.py)
TOOL_CALLS_TAG, TOOL_CALLS_END_TAG = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_END_TAG, PARAMETER_END_TAG = f"</{DSML}invoke>", f"</{DSML}parameter>"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"\n\n{TOOL_CALLS_TAG}\n", f"\n{TOOL_CALLS_END_TAG}"  # the block with its breaks


def _dsml(calls: list[dict] | None) -> str:
    """Tool calls as the DSML block that follows an assistant's answer ('' without calls)."""
    if not calls:
        return ""
    invokes = []
    for call in calls:
        parameters = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}{PARAMETER_END_TAG}'
            for key, value in _arguments(call, "a tool call").items())
        invokes.append(f'<{DSML}invoke name="{call["function"]["name"]}">\n{parameters}\n{INVOKE_END_TAG}')
    return TOOL_CALLS_OPEN + "\n".join(invokes) + TOOL_CALLS_CLOSE
