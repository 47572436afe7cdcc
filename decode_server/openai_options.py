"""vLLM's fields that shape a request's prompt, its answer's text and its stream: a chat template's
options, stop strings kept, special tokens written, tokens named by id, a truncated prompt, usage
in every streamed event."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from decode_server.openai_body import MAX_FIELD_NAME_CHARS, Body
from engine.tokenizer import ChatOptions
from serving.validation import InvalidRequest

MAX_TEMPLATE_KWARGS_CHARS = 8192  # chat_template_kwargs, as JSON
# chat_template_kwargs can't set what transformers' apply_chat_template takes itself, nor the messages
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize",
                                      "sanitize_control_tokens", "padding", "truncation", "max_length",
                                      "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                      "tokenizer_kwargs", "kwargs"})


@dataclass(frozen=True)
class OutputOptions:
    """How an answer's tokens become text (vLLM's fields of these names)."""

    include_stop: bool = False          # include_stop_str_in_output: the stop string ends the text
    skip_special_tokens: bool = True    # False: special tokens are written in the text too
    tokens_as_ids: bool = False         # return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"


def read_output_options(body: Body) -> OutputOptions:
    return OutputOptions(include_stop=body.flag("include_stop_str_in_output"),
                         skip_special_tokens=body.flag("skip_special_tokens", True),
                         tokens_as_ids=body.flag("return_tokens_as_token_ids"))


def read_stream_options(options: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, vLLM's continuous_usage_stats: every event carries its choice's usage so far)."""
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidRequest(f"stream_options.{unknown[0][:MAX_FIELD_NAME_CHARS]} is not supported by this server "
                             "(it takes include_usage and continuous_usage_stats); leave it out", "stream_options")
    body = Body(options)
    include_usage, continuous = body.flag("include_usage"), body.flag("continuous_usage_stats")
    if continuous and not include_usage:
        raise InvalidRequest("stream_options.continuous_usage_stats needs include_usage: true", "stream_options")
    return include_usage, continuous


def read_chat_options(body: Body) -> ChatOptions:
    """vLLM's: continue_final_message without add_generation_prompt leaves the turn unopened."""
    continued = body.flag("continue_final_message")
    opened = body.get("add_generation_prompt", bool, "true or false")
    if continued and opened:
        raise InvalidRequest("add_generation_prompt and continue_final_message can't both be true: the answer "
                             "either opens a new turn or continues the last message", "continue_final_message")
    kwargs = body.get("chat_template_kwargs", dict, "an object") or {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequest(f"chat_template_kwargs can't set {', '.join(reserved)}: the request's own fields do",
                             "chat_template_kwargs")
    if any(not key.isidentifier() for key in kwargs):
        raise InvalidRequest("chat_template_kwargs' keys must be names a template can read (letters, digits, _)",
                             "chat_template_kwargs")
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(f"chat_template_kwargs holds more than {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON",
                             "chat_template_kwargs")
    return ChatOptions(add_generation_prompt=not continued if opened is None else opened,
                       continue_final_message=continued, template_kwargs=kwargs)


def read_truncate_prompt_tokens(body: Body) -> int:
    """vLLM's: keep the prompt's last k tokens, k >= 1, or -1 for as many as the context holds."""
    value = body.integer("truncate_prompt_tokens", 0, -1, 2**31)
    if "truncate_prompt_tokens" in body.data and value == 0:
        raise InvalidRequest("truncate_prompt_tokens must be at least 1 (or -1: as many as the context holds), "
                             "got 0", "truncate_prompt_tokens")
    return value
