"""The OpenAI API's request bodies (`/v1/completions`, `/v1/chat/completions`) read into the
decode server's `RequestFields`, each field's type checked here and its limits in
decode_server.request_parser, as for gRPC. Every field is honoured or refused: one this server
knows but does not implement is refused unless it holds its default, and an unknown one is refused
too (or, with --ignore-unknown-fields, taken with a warning), so no answer looks valid while a field
that would have changed it was dropped."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from decode_server.config import PrefillMode
from decode_server.openai_body import MAX_FIELD_NAME_CHARS, Body
from decode_server.openai_grammar import FIELDS as GRAMMAR_FIELDS
from decode_server.openai_grammar import read_grammar
from decode_server.openai_options import (
    OutputOptions,
    read_chat_options,
    read_output_options,
    read_stream_options,
    read_truncate_prompt_tokens,
)
from decode_server.openai_prompt import check_text, read_messages, read_prompt
from decode_server.openai_responses import ResponsesFields, chat_body, responses_refusal
from decode_server.openai_tools import Tools, read_tools
from decode_server.request_fields import MAX_STOP_TOKEN_IDS, FieldNames, RequestFields
from engine.penalty_spec import Penalties
from engine.tokenizer import ChatOptions
from serving.validation import InvalidRequest

OPENAI_NAMES = FieldNames(request_id="X-Request-Id", prompt="prompt", token_ids="prompt",
                          max_new_tokens="max_tokens", sampling="", stop_token_ids="stop_token_ids",
                          prefill_mode="prefill_mode", chunk_size="chunk_size")
CHAT_NAMES = replace(OPENAI_NAMES, prompt="messages", token_ids="messages")
RESPONSES_NAMES = replace(OPENAI_NAMES, prompt="input", token_ids="input", max_new_tokens="max_output_tokens")

INT32 = (-(2**31), 2**31)  # the proto's int32 fields' range, [low, high)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 64
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_CHOICES = 16          # n: each choice reserves the KV of its whole answer
MAX_LOGIT_BIAS = 1024     # tokens a request may bias (vLLM has no limit; OpenAI takes 300)
MAX_TOP_LOGPROBS = 20     # OpenAI's limit on top_logprobs
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256
# Fields this server honours: read below (`user` only names the end user in OpenAI's monitoring, and
# `cache_salt` belongs to the prefix cache).
HONOURED = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
                      "top_k", "ignore_eos", "stop_token_ids", "prefill_mode", "chunk_size", "prefill_sms", "user",
                      "cache_salt", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                      "min_p", "min_tokens", "allowed_token_ids", "bad_words", "prompt_logprobs",
                      "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
                      "return_tokens_as_token_ids", *GRAMMAR_FIELDS})
HONOURED_BY = {False: HONOURED | {"prompt", "logprobs", "echo"},
               True: HONOURED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "echo",
                                 "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                                 "continue_final_message", "chat_template_kwargs"}}
# Fields of OpenAI's or vLLM's API that this server does not implement: taken only at the value
# that asks for nothing (null always), refused otherwise, as the answer would not be what they ask.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "suffix": (), "tools": ([],), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (True, False),
    "best_of": (1,), "guided_decoding_backend": (),
    "spaces_between_special_tokens": (True,), "chat_template": (),
    "documents": (), "use_beam_search": (False,), "length_penalty": (1,),
    "priority": (0,), "store": (False,), "metadata": (),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (), "service_tier": ("auto",),
    "web_search_options": (), "verbosity": ()}


@dataclass(frozen=True)
class ApiRequest:
    chat: bool
    model: str | None
    fields: RequestFields        # a chat's prompt is still empty: `messages` go through its template
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    echo: bool = False           # completions: the prompt's text (and log probabilities) before the answer's;
                                 # chat (vLLM's): the last message's text, where it is the assistant's
    n: int = 1                   # choices, each its own sequence (the prompt's KV shared through the prefix cache)
    tools: Tools | None = None   # chat: the functions it may call, and how (`tool_choice`)
    prompt_logprobs: int | None = None  # vLLM's: the prompt's log probabilities, this many alternatives each
    output: OutputOptions = OutputOptions()
    chat_options: ChatOptions = field(default_factory=ChatOptions)  # chat: how its template renders it
    continuous_usage: bool = False  # streamed: every event carries its choice's usage so far
    responses: ResponsesFields | None = None  # a Responses API request: what its Response repeats
    echo_text: str = ""  # chat with echo: the last message's text, where it is the assistant's


def _asks_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    """null, or one of the field's do-nothing values (true/false are no numbers here)."""
    return value is None or any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def check_fields(body: Body, chat: bool, ignore_unknown: bool) -> list[str]:
    """Refuses what would not be honoured; returns the unknown fields taken (with ignore_unknown)."""
    honoured, unknown = HONOURED_BY[chat], []
    for name, value in body.data.items():
        if name in honoured:
            continue
        if name == "tool_choice":
            if value is not None and not body.data.get("tools"):
                raise InvalidRequest("tool_choice is only allowed when tools are given", "tool_choice")
            continue  # tools themselves are refused as not implemented
        if name in NOT_IMPLEMENTED:
            if not _asks_nothing(value, NOT_IMPLEMENTED[name]):
                raise InvalidRequest(f"{name} is not supported by this server; leave it out", name)
            continue
        if not ignore_unknown:
            shown = name[:MAX_FIELD_NAME_CHARS]
            raise InvalidRequest(f"unknown field {shown!r}: this server does not implement it; leave it out (a server "
                                 "started with --ignore-unknown-fields takes it with a warning)", shown)
        unknown.append(name[:MAX_FIELD_NAME_CHARS])
    return unknown


def read_request(data: Any, chat: bool, request_id: str, max_items: int,
                 ignore_unknown: bool = False) -> tuple[ApiRequest, list[str]]:
    """The request and the unknown fields it held (refused unless `ignore_unknown`). A chat without
    max_tokens leaves it None: the request parser gives it the server's default, capped by the
    context. `max_items` (the context length) bounds a prompt's token ids and a chat's messages
    before any per-item work: neither can be longer and still fit."""
    body = Body(data)
    unknown = check_fields(body, chat, ignore_unknown)
    model = body.get("model", str, "a string")
    body.get("user", str, "a string")
    n = body.integer("n", 1, 1, MAX_CHOICES + 1)
    stream = body.flag("stream")
    options = body.get("stream_options", dict, "an object")
    if options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    include_usage, continuous_usage = read_stream_options(options or {})
    max_tokens = _max_tokens(body, chat)
    stop = _stop_strings(body.data.get("stop"))
    stop_ids = body.get("stop_token_ids", list, "an array of token ids") or []
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"{len(stop_ids)} stop_token_ids; the limit is {MAX_STOP_TOKEN_IDS}", "stop_token_ids")
    if any(not isinstance(t, int) or isinstance(t, bool) for t in stop_ids):
        raise InvalidRequest("stop_token_ids must be an array of integers", "stop_token_ids")
    mode = body.get("prefill_mode", str, f"one of {', '.join(PrefillMode)}")
    if mode is not None and mode not in tuple(PrefillMode):
        raise InvalidRequest(f"prefill_mode must be one of {', '.join(PrefillMode)}, got {mode!r}", "prefill_mode")
    messages: list[dict[str, Any]] = []
    token_ids: list[int] = []
    prompt = ""
    if chat:
        messages = read_messages(body.data.get("messages"), max_items)
    else:
        prompt, token_ids = read_prompt(body.data.get("prompt"), max_items)
    top_p = body.float32("top_p", 1.0)
    if not 0 < top_p <= 1:  # 0 would keep no token (over gRPC, where fields can't be unset, 0 is "off")
        raise InvalidRequest(f"top_p must be in (0, 1], got {body.data['top_p']}", "top_p")
    seed = body.get("seed", int, "an integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidRequest(f"seed must be in [0, {2**64}), got {seed}", "seed")
    fields = RequestFields(
        request_id=request_id, token_ids=token_ids, prompt=prompt, add_special_tokens=True, max_new_tokens=max_tokens,
        temperature=body.float32("temperature", 1.0), top_p=top_p, top_k=_top_k(body.integer("top_k", 0, *INT32)),
        seed=seed, stop_token_ids=stop_ids, ignore_eos=body.flag("ignore_eos"),
        prefill_mode=PrefillMode(mode).number if mode else 0, chunk_size=body.integer("chunk_size", 0, *INT32),
        prefill_sms=body.integer("prefill_sms", 0, *INT32), logprobs=_logprobs(body, chat),
        penalties=_penalties(body), bad_words=_bad_words(body), cache_salt=_cache_salt(body),
        truncate_prompt_tokens=read_truncate_prompt_tokens(body))
    echo = body.flag("echo")
    echo_text = messages[-1]["content"] if echo and chat and messages[-1]["role"] == "assistant" else ""
    grammar = read_grammar(body.data)
    tools = read_tools(body.data) if chat else None
    if tools is not None and echo:
        raise InvalidRequest("echo is not supported with tools: an echoed message is no tool call's text; leave "
                             "one out", "echo")
    forced = tools.grammar() if tools is not None else None
    if forced is not None:  # tool_choice required or named: the answer is held to the tools' schema
        if grammar is not None:
            raise InvalidRequest(f"tool_choice and {grammar[1]} both ask for a structured output; send one",
                                 "tool_choice")
        grammar = forced, "tool_choice"
    prompt_logprobs = body.get("prompt_logprobs", int, "an integer")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}",
                             "prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise InvalidRequest("prompt_logprobs is not supported with stream: true; leave one out", "prompt_logprobs")
    # the prompt's log probabilities, with as many alternatives as the echo or prompt_logprobs wants
    echoed = fields.logprobs if echo and not chat and fields.logprobs is not None else None
    wanted = [k for k in (echoed, prompt_logprobs) if k is not None]
    fields = replace(fields, prompt_logprobs=max(wanted) if wanted else None, prompt_ranks=prompt_logprobs is not None,
                     grammar=grammar and grammar[0],
                     grammar_field=grammar[1] if grammar else "")
    output = read_output_options(body)
    return ApiRequest(chat, model, fields, messages, stream, include_usage, stop, echo, n, tools,
                      prompt_logprobs, output, read_chat_options(body) if chat else ChatOptions(),
                      continuous_usage, echo_text=echo_text), unknown


def _logprobs(body: Body, chat: bool) -> int | None:
    """How many alternatives to each token's log probability; None: no log probabilities. Completions'
    `logprobs: 0` asks for the sampled token's alone; chat's `logprobs: true` with `top_logprobs`."""
    if not chat:
        value = body.get("logprobs", int, "an integer")
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {value}", "logprobs")
        return value if value is None else int(value)
    wanted = body.flag("logprobs")
    top = body.get("top_logprobs", int, "an integer")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _penalties(body: Body) -> Penalties | None:
    """None when every penalty and filter is at its do-nothing value."""
    def number(name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = body.float32(name, default)
        if not (low < value if low_open else low <= value) or value > high:
            raise InvalidRequest(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got "
                                 f"{body.data[name]}", name)
        return value

    bias = body.get("logit_bias", dict, "an object of token id: bias") or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or isinstance(value, bool) or not isinstance(value, int | float) \
                or not -100 <= value <= 100:
            raise InvalidRequest("logit_bias maps token ids (as strings) to numbers in [-100, 100], got "
                                 f"{key[:20]!r}: {str(value)[:20]}", "logit_bias")
        pairs.append((int(key), float(value)))
    allowed = body.get("allowed_token_ids", list, "an array of token ids") or []
    if len(allowed) > MAX_LOGIT_BIAS or any(not isinstance(t, int) or isinstance(t, bool) for t in allowed):
        raise InvalidRequest(f"allowed_token_ids must be an array of at most {MAX_LOGIT_BIAS} token ids",
                             "allowed_token_ids")
    penalties = Penalties(
        presence=number("presence_penalty", 0.0, -2, 2), frequency=number("frequency_penalty", 0.0, -2, 2),
        repetition=number("repetition_penalty", 1.0, 0, 2, low_open=True), logit_bias=tuple(sorted(pairs)),
        min_tokens=body.integer("min_tokens", 0, 0, 2**31), min_p=number("min_p", 0.0, 0, 1),
        allowed=tuple(sorted(set(allowed))))
    return penalties if penalties.active else None


def _bad_words(body: Body) -> tuple[str, ...]:
    words = body.get("bad_words", list, "an array of strings") or []
    if len(words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS
                                         for w in words):
        raise InvalidRequest(f"bad_words must be an array of at most {MAX_BAD_WORDS} non-blank strings of at most "
                             f"{MAX_BAD_WORD_CHARS} characters", "bad_words")
    return tuple(words)


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
        check_text(s, "stop")
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise InvalidRequest(f"every stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}", "stop")
    return tuple(stops)


def read_responses_request(data: Any, request_id: str, max_items: int,
                           ignore_unknown: bool = False) -> tuple[ApiRequest, list[str]]:
    """A Responses API request, read as the chat it becomes (openai_responses.py); refusals name its fields."""
    try:
        chat, echoed, unknown = chat_body(data, ignore_unknown)
        api, _ = read_request(chat, True, request_id, max_items)
    except InvalidRequest as e:
        raise responses_refusal(e) from None
    grammar_field = "text" if api.fields.grammar_field == "response_format" else api.fields.grammar_field
    return replace(api, responses=echoed, fields=replace(api.fields, grammar_field=grammar_field)), unknown
