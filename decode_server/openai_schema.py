"""The OpenAI API's request bodies (`/v1/completions`, `/v1/chat/completions`) read into the
decode server's `RequestFields`, each field's type checked here and its limits in
decode_server.request_parser, as for gRPC. Fields this server does not implement are ignored, as
OpenAI clients send many of them at their defaults; those that would change the answer are refused."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from decode_server.config import PrefillMode
from decode_server.request_parser import FieldNames, RequestFields
from serving.validation import InvalidRequest

OPENAI_NAMES = FieldNames(request_id="X-Request-Id", prompt="prompt", token_ids="prompt",
                          max_new_tokens="max_tokens", sampling="sampling", stop_token_ids="stop_token_ids",
                          prefill_mode="prefill_mode", chunk_size="chunk_size")
CHAT_NAMES = replace(OPENAI_NAMES, prompt="messages", token_ids="messages")

INT32 = (-(2**31), 2**31)  # the proto's int32 fields' range, [low, high)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
ROLES = ("system", "developer", "user", "assistant", "tool")
# Answers they would change, so a request that asks for them is refused rather than answered without.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias", "response_format",
               "frequency_penalty", "presence_penalty", "best_of")


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    model: str | None
    fields: RequestFields        # a chat's prompt is still empty: `messages` go through its template
    messages: list[dict[str, str]]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {} or value == ""


class Body:
    """Typed reads of a JSON object's fields; a wrong type is one line naming the field."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise InvalidRequest(f"the request body must be a JSON object, got {type(data).__name__}")
        self.data: dict[str, Any] = data

    def get(self, name: str, kind: type | tuple[type, ...], what: str) -> Any:
        value = self.data.get(name)
        # JSON's true/false are Python ints too; they are not numbers here
        if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and bool not in
                                                                    (kind if isinstance(kind, tuple) else (kind,)))):
            raise InvalidRequest(f"{name} must be {what}, got {json_type(value)}", name)
        return value

    def integer(self, name: str, default: int, low: int | None = None, high: int | None = None) -> int:
        value = self.get(name, int, "an integer")
        if value is None:
            return default
        if (low is not None and value < low) or (high is not None and value >= high):
            raise InvalidRequest(f"{name} must be in [{low}, {high}), got {value}", name)
        return int(value)

    def float32(self, name: str, default: float) -> float:
        """A number as the proto's float fields hold it, so that a request samples the same tokens
        over HTTP as over gRPC (and a top_p below float32's range is 0 there too, not a filter
        that keeps nothing)."""
        value = self.get(name, (int, float), "a number")
        if value is None:
            return default
        try:
            rounded: float = struct.unpack("f", struct.pack("f", value))[0]
        except (OverflowError, struct.error):
            rounded = math.inf
        if not math.isfinite(rounded):
            raise InvalidRequest(f"{name} must be a finite 32-bit number, got {value}", name)
        return rounded

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.get(name, bool, "true or false")
        return default if value is None else bool(value)


def json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def read_request(data: Any, chat: bool, request_id: str) -> ApiRequest:
    """A chat without max_tokens leaves it None: the request parser gives it the server's default,
    capped by the context."""
    body = Body(data)
    for name in UNSUPPORTED:
        if not _is_unset(body.data.get(name)):
            raise InvalidRequest(f"{name} is not supported by this server; leave it out", name)
    model = body.get("model", str, "a string")
    if body.integer("n", 1) != 1:
        raise InvalidRequest("n must be 1: this server returns one choice per request", "n")
    stream = body.flag("stream")
    options = body.get("stream_options", dict, "an object")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    include_usage = Body(options or {}).flag("include_usage")
    max_tokens = _max_tokens(body, chat)
    stop = _stop_strings(body.data.get("stop"))
    stop_ids = body.get("stop_token_ids", list, "an array of token ids") or []
    if any(not isinstance(t, int) or isinstance(t, bool) for t in stop_ids):
        raise InvalidRequest("stop_token_ids must be an array of integers", "stop_token_ids")
    mode = body.get("prefill_mode", str, f"one of {', '.join(PrefillMode)}")
    if mode is not None and mode not in tuple(PrefillMode):
        raise InvalidRequest(f"prefill_mode must be one of {', '.join(PrefillMode)}, got {mode!r}", "prefill_mode")
    messages: list[dict[str, str]] = []
    token_ids: list[int] = []
    prompt = ""
    if chat:
        messages = _messages(body.data.get("messages"))
    else:
        prompt, token_ids = _prompt(body.data.get("prompt"))
    fields = RequestFields(
        request_id=request_id, token_ids=token_ids, prompt=prompt, max_new_tokens=max_tokens,
        temperature=body.float32("temperature", 1.0), top_p=body.float32("top_p", 1.0),
        top_k=_top_k(body.integer("top_k", 0, *INT32)),
        seed=body.integer("seed", 0, 0, 2**64), stop_token_ids=stop_ids, ignore_eos=body.flag("ignore_eos"),
        prefill_mode=PrefillMode(mode).number if mode else 0, chunk_size=body.integer("chunk_size", 0, *INT32),
        prefill_sms=body.integer("prefill_sms", 0, *INT32), cache_salt=_cache_salt(body))
    return ApiRequest(chat, model, fields, messages, stream, include_usage, stop)


def _cache_salt(body: Body) -> str:
    """vLLM's field: a non-empty string when given (its limits are checked with gRPC's)."""
    salt = body.get("cache_salt", str, "a non-empty string")
    if salt == "":
        raise InvalidRequest("cache_salt must be a non-empty string when given; leave it out for none", "cache_salt")
    return salt or ""


def _top_k(value: int) -> int:
    return 0 if value == -1 else value  # vLLM's -1 = off, as our 0


def _max_tokens(body: Body, chat: bool) -> int | None:
    if chat:
        value = body.get("max_completion_tokens", int, "an integer")
        if value is not None:
            return int(value)
    value = body.get("max_tokens", int, "an integer")
    if value is not None:
        return int(value)
    return None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise InvalidRequest("stop must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(stops)} strings; the limit is {MAX_STOP_STRINGS}", "stop")
    for s in stops:
        _check_text(s, "stop")
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise InvalidRequest(f"every stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
    return tuple(stops)


def _prompt(value: Any) -> tuple[str, list[int]]:
    """One prompt: text or token ids (also as a batch of one); a batch of several is refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("prompt is empty", "prompt")
        return _check_text(value, "prompt"), []
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return "", value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise InvalidRequest(f"prompt holds {len(value)} prompts; this server takes one per request", "prompt")
    raise InvalidRequest("prompt must be a non-empty string or array of token ids", "prompt")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object, got {json_type(message)}", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        out.append({"role": role, "content": _content(message.get("content"), i)})
    return out


def _content(value: Any, i: int) -> str:
    """Text, or an array of text parts (joined); no images or audio."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _check_text(value, "messages")
    if isinstance(value, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return _check_text("".join(p["text"] for p in value), "messages")
    raise InvalidRequest(f"messages[{i}].content must be a string or an array of text parts "
                         "({\"type\": \"text\", \"text\": ...})", "messages")


def _check_text(text: str, name: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (an escaped d800), which is no text a tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{name} holds a lone UTF-16 surrogate at character {e.start}; send valid "
                             "Unicode text", name) from None
    return text
