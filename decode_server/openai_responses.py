"""OpenAI's Responses API (`POST /v1/responses`) on the chat path. A request's `instructions` and
`input` items become a chat's messages and its fields the chat's, checked by the same rules; the
chat's answer becomes a Response: output items (a message of `output_text`, function calls), whole or
streamed as the Responses API's typed events (`ResponseEvents`, in place of chat's chunks). Nothing
is stored, so `store`, `previous_response_id` and `background` are refused where they would need it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from decode_server.openai_body import MAX_FIELD_NAME_CHARS, Body
from decode_server.openai_prompt import json_type
from serving.validation import InvalidRequest

# read here and handed to the chat reader under chat's names, or checked here
HONOURED = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                      "tools", "tool_choice", "parallel_tool_calls", "text", "user", "metadata",
                      "prompt_cache_key"})
# fields taken only at the value that asks for nothing
DO_NOTHING: dict[str, tuple[Any, ...]] = {
    "store": (False,), "previous_response_id": (), "background": (False,), "include": ([],), "reasoning": (),
    "truncation": ("disabled",), "service_tier": ("auto", "default"), "top_logprobs": (0,),
    "stream_options": ({},), "conversation": (), "prompt": (), "max_tool_calls": (), "safety_identifier": ()}
CHAT_NAME = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}
MAX_METADATA = 16


@dataclass(frozen=True)
class ResponsesFields:
    """What a Response repeats of its request."""

    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


def chat_body(data: Any, ignore_unknown: bool) -> tuple[dict[str, Any], ResponsesFields, list[str]]:
    """The chat request this Responses request is, what its Response repeats, and the unknown fields
    it held (refused unless `ignore_unknown`)."""
    body = Body(data)
    unknown: list[str] = []
    for name, value in body.data.items():
        if name in HONOURED:
            continue
        if name in DO_NOTHING:
            if value is not None and not any(value == d and type(value) is type(d) for d in DO_NOTHING[name]):
                raise InvalidRequest(f"{name} is not supported by this server (it stores no responses and runs no "
                                     "reasoning); leave it out", name)
            continue
        shown = name[:MAX_FIELD_NAME_CHARS]
        if not ignore_unknown:
            raise InvalidRequest(f"unknown field {shown!r}: /v1/responses does not implement it; leave it out (a "
                                 "server started with --ignore-unknown-fields takes it with a warning)", shown)
        unknown.append(shown)
    instructions = body.get("instructions", str, "a string")
    body.get("prompt_cache_key", str, "a string")  # a routing hint: the prefix cache serves every prompt
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(body.data)
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls"):
        if body.data.get(name) is not None:
            chat[name] = body.data[name]
    if body.data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body.data["max_output_tokens"]
    tools = [_chat_tool(t, i) for i, t in enumerate(body.get("tools", list, "an array of tools") or [])]
    if tools:
        chat["tools"] = tools
    if body.data.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body.data["tool_choice"])
    text = body.get("text", dict, "an object") or {}
    response_format = _response_format(text)
    if response_format is not None:
        chat["response_format"] = response_format
    echoed = ResponsesFields(
        instructions=instructions, tools=list(body.data.get("tools") or []),
        tool_choice=body.data.get("tool_choice") or "auto",
        parallel_tool_calls=body.data.get("parallel_tool_calls") is not False,
        text={"format": text.get("format") or {"type": "text"}}, metadata=_metadata(body),
        max_output_tokens=body.data.get("max_output_tokens"), temperature=body.data.get("temperature"),
        top_p=body.data.get("top_p"))
    return chat, echoed, unknown


def responses_refusal(e: InvalidRequest) -> InvalidRequest:
    """A refusal of the chat this request became, naming the Responses API's fields."""
    message = str(e)
    for chat_name, name in CHAT_NAME.items():
        message = message.replace(chat_name, name)
    return InvalidRequest(message, CHAT_NAME.get(e.param or "", e.param))


def _messages(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    value = data.get("input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty array of input items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"input[{i}] must be an object, got {json_type(item)}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # one assistant turn, however many calls it made
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _string(item, "output", i)})
        else:
            raise InvalidRequest(f"input[{i}] is a {str(kind)[:40]!r} item; this server takes message, "
                                 "function_call and function_call_output items", "input")
    return messages


def _text(content: Any, i: int) -> Any:
    """A message's text: a string, or its input_text / output_text parts joined."""
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") in ("input_text", "output_text")
                   and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequest(f"input[{i}].content must be a string or an array of input_text parts "
                                 "(no images or files)", "input")
        return "".join(p["text"] for p in content)
    return content  # a string, or what the chat reader refuses by name


def _string(item: Mapping[str, Any], name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"input[{i}].{name} must be a string, got {json_type(value)}", "input")
    return value


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"name\": ..., \"parameters\": {{...}}}}; "
                             "this server runs no built-in tools", "tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required", or what the chat reader refuses


def _response_format(text: Mapping[str, Any]) -> dict[str, Any] | None:
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise InvalidRequest(f"text.{unknown[0][:MAX_FIELD_NAME_CHARS]} is not supported by this server; leave it "
                             "out", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_object", "json_schema"):
        raise InvalidRequest("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                             "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _metadata(body: Body) -> dict[str, str]:
    metadata = body.get("metadata", dict, "an object of strings") or {}
    if len(metadata) > MAX_METADATA or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                                               and len(v) <= 512 for k, v in metadata.items()):
        raise InvalidRequest(f"metadata holds at most {MAX_METADATA} pairs of strings (keys up to 64 characters, "
                             "values up to 512)", "metadata")
    return dict(metadata)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, created: int, model: str, echoed: ResponsesFields, status: str,
                    output: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
    """A Response; `status` completed, incomplete (its answer ran out of max_output_tokens) or in_progress."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echoed.instructions, "output": output, "tools": echoed.tools,
        "tool_choice": echoed.tool_choice, "parallel_tool_calls": echoed.parallel_tool_calls, "text": echoed.text,
        "metadata": echoed.metadata, "max_output_tokens": echoed.max_output_tokens,
        "temperature": echoed.temperature, "top_p": echoed.top_p, "store": False, "truncation": "disabled",
        "previous_response_id": None, "reasoning": None,
        "usage": None if usage is None else {
            "input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}}


def output_of(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's message as Response output items: its text, then its function calls."""
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed"))
    for call in message.get("tool_calls") or []:
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                               "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    done = status == "completed"
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def event(kind: str, sequence: int, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **fields})}\n\n".encode()
