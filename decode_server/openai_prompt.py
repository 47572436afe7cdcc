"""A request's prompt (text or token ids) and a chat's messages (roles, text parts, earlier tool
calls and their answers), checked before any per-item work: neither may be longer than the context."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from serving.validation import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
TOKEN_ID_RANGE = (0, 2**31)  # the proto's token ids are int32; the vocabulary check comes later


def json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def read_prompt(value: Any, max_items: int) -> tuple[str, list[int]]:
    """One prompt: text or token ids (also as a batch of one); a batch of several is refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("prompt is empty", "prompt")
        return check_text(value, "prompt"), []
    if isinstance(value, list) and len(value) > max_items:
        raise InvalidRequest(f"prompt holds {len(value)} items; no prompt longer than the context limit of "
                             f"{max_items} tokens fits", "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        low, high = TOKEN_ID_RANGE
        for position, token in enumerate(value):
            if not low <= token < high:
                raise InvalidRequest(f"token id {token} at position {position} of prompt is outside the vocabulary",
                                     "prompt")
        return "", value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise InvalidRequest(f"prompt holds {len(value)} prompts; this server takes one per request", "prompt")
    raise InvalidRequest("prompt must be a non-empty string or array of token ids", "prompt")


def read_messages(value: Any, max_items: int) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array of {role, content} objects", "messages")
    if len(value) > max_items:  # every message is at least one token of the rendered chat
        raise InvalidRequest(f"messages holds {len(value)} messages; no chat of more than the context limit of "
                             f"{max_items} tokens fits", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object, got {json_type(message)}", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        out.append({"role": role, "content": _content(message.get("content"), i), **_tool_parts(message, i)})
    return out


def _tool_parts(message: Mapping[str, Any], i: int) -> dict[str, Any]:
    """An assistant's earlier tool calls (their arguments as objects, as chat templates take them) and a
    tool message's call id and name."""
    parts: dict[str, Any] = {k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)}
    calls = message.get("tool_calls")
    if calls is None:
        return parts
    if not isinstance(calls, list) or any(not isinstance(c, Mapping) or not isinstance(c.get("function"), Mapping)
                                          for c in calls):
        raise InvalidRequest(f"messages[{i}].tool_calls must be an array of {{\"function\": {{...}}}}", "messages")
    parts["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                           for c in calls]
    return parts


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _content(value: Any, i: int) -> str:
    """Text, or an array of text parts (joined); no images or audio."""
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(value, "messages")
    if isinstance(value, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return check_text("".join(p["text"] for p in value), "messages")
    raise InvalidRequest(f"messages[{i}].content must be a string or an array of text parts "
                         "({\"type\": \"text\", \"text\": ...})", "messages")


def check_text(text: str, name: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (an escaped d800), which is no text a tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{name} holds a lone UTF-16 surrogate at character {e.start}; send valid "
                             "Unicode text", name) from None
    return text
