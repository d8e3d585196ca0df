"""DeepSeek-V4's chat encoding: messages to the prompt text the model was trained on.

The release's ``encoding/encoding_dsv4.py`` is the source of truth (its model card); the rules, as
``v4-architecture.md`` §8.3 records them: ``BOS [system] <｜User｜>message<｜Assistant｜>``, then ``</think>`` to
answer directly or ``<think>`` to reason first; an earlier assistant turn is ``</think>answer EOS`` (its reasoning
is not replayed); tool results go inside the user turn as ``<tool_result>...</tool_result>``.
"""

from __future__ import annotations

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
ROLES = ("system", "user", "assistant", "tool")


def encode_chat(messages: list[dict], thinking: bool = False) -> str:
    """The prompt for the assistant's next turn. ``messages``: dicts with ``role`` (system, user, assistant, tool)
    and ``content`` (str); system messages come first; consecutive user and tool messages form one user turn; the
    conversation ends with a user or tool message."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    parts, turn, opening = [BOS], [], True
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a str 'content', got {message!r}")
        role, content = message.get("role"), message["content"]
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "system":
            if not opening:
                raise ValueError(f"messages[{i}]: system messages must come before the others")
            parts.append(content)
            continue
        opening = False
        if role == "assistant":
            if not turn:
                raise ValueError(f"messages[{i}]: an assistant message must follow a user or tool message")
            parts += [USER, "".join(turn), ASSISTANT, END_THINK, content, EOS]
            turn = []
        else:
            turn.append(content if role == "user" else f"<tool_result>{content}</tool_result>")
    if not turn:
        raise ValueError("the last message must be a user or tool message: the model answers it")
    parts += [USER, "".join(turn), ASSISTANT, THINK if thinking else END_THINK]
    return "".join(parts)
