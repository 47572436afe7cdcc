"""Large bodies parsed, and large chats read, rendered by their template and tokenized, in a separate
process.

Every value parsed, every message checked and every line of a chat template rendered (jinja is pure
Python) holds the GIL, in slices of the switch interval; every decode step gives the GIL up and
takes it back at each call into torch, so it waits up to a slice at each one meanwhile (a convoy):
a chat of thousands of messages held other users' tokens for tenths of a second. So a chat body past
POOL_BODY_BYTES is handed as bytes to a worker process with its own copy of the tokenizer, which
parses, checks, renders and tokenizes it; one with more than POOL_MESSAGES messages in a smaller body
is rendered and tokenized there. This process only copies the bytes or pickles the messages over,
and takes the prompt's ids back as one packed protobuf field, which it reads in C in one pass (as
both servers hold a prompt, `serving/token_ids.py`). Any other body past POOL_BODY_BYTES is parsed
there too, and pickled back: unpickling a 2 MB prompt holds the GIL about 1 ms, where `json.loads`
holds it 5-7 ms (it gives the GIL up nowhere, not even on a worker thread). The worker starts
with the HTTP server, beside it: its imports take seconds (4-11 s measured), which no request
should wait for, and starting it pickles the tokenizer over, which holds the event loop."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Any

import grpc
from pd.v1 import decode_pb2

from decode_server.http_request import ApiError, count_values, parse_json, too_complex
from decode_server.openai_responses import responses_refusal
from decode_server.openai_schema import ApiRequest, read_request, read_responses_request
from decode_server.openai_tools import Tools, family_of
from decode_server.request_fields import RequestFields, check_text_fits, encode_prompt
from engine.tokenizer import ChatOptions, ChatTemplateError, Tokenizer
from serving.validation import InvalidRequest

log = logging.getLogger(__name__)

# Rendering takes about 10 us a message and parsing a chat about 1 ms a 100 KiB: below these a chat
# costs the decode steps a few ms at most, and skips the trip to the worker.
POOL_BODY_BYTES = 256 << 10  # bodies past this are parsed (a chat also read) in the worker
POOL_MESSAGES = 256          # chats of more messages than this are rendered there
WORKERS = 1

_tokenizer: Tokenizer | None = None  # the worker's own


def chat_text(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: Tools | None, options: ChatOptions,
              max_model_len: int) -> str:
    """The chat's prompt through its template, or the refusal of a chat this server can't take."""
    if tools is not None and family_of(tokenizer.chat_template) is None:
        raise InvalidRequest("this model's chat template takes no tools (or no known tool-call format: hermes, "
                             "Llama 3 JSON); leave tools out", "tools")
    check_text_fits(sum(len(m["content"]) for m in messages), max_model_len, "messages", "messages")
    try:
        return tokenizer.render_chat(messages, tools.tools if tools else None, options)
    except ChatTemplateError as e:
        raise InvalidRequest(str(e), "messages") from e


def _packed_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: Tools | None, options: ChatOptions,
                max_model_len: int, truncate: int) -> bytes:
    """The rendered chat's ids (its last `truncate`, where given), packed. The template writes its BOS."""
    text = chat_text(tokenizer, messages, tools, options, max_model_len)
    ids = encode_prompt(tokenizer, text, max_model_len, False, truncate, "messages through the chat template",
                        "messages")  # read as a prompt of the same text is
    return decode_pb2.GenerateRequest(token_ids=ids).SerializeToString()


# --- in the worker: each answers ("ok", value), ("invalid", (message, param)) or ("api", ApiError args)
def _start_worker(tokenizer: Tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _parse(raw: bytes, max_values: int) -> tuple[str, Any]:
    """Any body, as `parse_body` would read it."""
    try:
        data = parse_json(raw)
        if count_values(data, max_values) > max_values:
            raise too_complex(max_values)
    except ApiError as e:  # the refusals a body parsed in the server gets
        return "api", (e.status, str(e), e.code)
    return "ok", data


def _read_chat(raw: bytes, request_id: str, max_model_len: int, max_values: int,
               ignore_unknown: bool, responses: bool) -> tuple[str, Any]:
    """A chat's body (or a Responses API request's, read as the chat it becomes)."""
    assert _tokenizer is not None
    kind, data = _parse(raw, max_values)
    if kind != "ok":
        return kind, data
    try:
        api, unknown = (read_responses_request(data, request_id, max_model_len, ignore_unknown) if responses
                        else read_request(data, True, request_id, max_model_len, ignore_unknown))
        packed = _packed_ids(_tokenizer, api.messages, api.tools, api.chat_options, max_model_len,
                             api.fields.truncate_prompt_tokens)
    except InvalidRequest as e:
        e = responses_refusal(e) if responses else e
        return "invalid", (str(e), e.param)
    return "ok", (replace(api, messages=[]), unknown, packed)


def _ready() -> bool:
    return _tokenizer is not None


def _render(messages: list[dict[str, Any]], tools: Tools | None, options: ChatOptions, max_model_len: int,
            truncate: int) -> tuple[str, Any]:
    assert _tokenizer is not None
    try:
        return "ok", _packed_ids(_tokenizer, messages, tools, options, max_model_len, truncate)
    except InvalidRequest as e:
        return "invalid", (str(e), e.param)


# --- in the server ----------------------------------------------------------------------------------
class ChatRenderPool:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """The worker process, started now and left to import in the background; one that fails
        to start is replaced by the first call that needs it."""
        self._executor().submit(_ready)

    def wait_started(self) -> list[int]:
        """Block until the worker answers; its process ids (`bench.micro.render_worker`)."""
        executor = self._executor()
        executor.submit(_ready).result()
        return list(executor._processes)

    async def read_chat(self, raw: bytes, request_id: str, max_model_len: int, max_values: int,
                        ignore_unknown: bool, responses: bool = False) -> tuple[ApiRequest, list[str]]:
        """A chat body read as `read_request` reads it (a Responses API body as `read_responses_request`
        does), with its prompt's ids in its fields."""
        api, unknown, packed = await self._call(_read_chat, raw, request_id, max_model_len, max_values,
                                                ignore_unknown, responses)
        return replace(api, fields=_with_ids(api.fields, packed)), unknown

    async def parse(self, raw: bytes, max_values: int) -> Any:
        """A body past POOL_BODY_BYTES as JSON, refused as `parse_body` refuses it."""
        return await self._call(_parse, raw, max_values)

    async def render(self, fields: RequestFields, messages: list[dict[str, Any]], tools: Tools | None,
                     options: ChatOptions, max_model_len: int) -> RequestFields:
        """`fields` with the chat's prompt ids."""
        return _with_ids(fields, await self._call(_render, messages, tools, options, max_model_len,
                                                  fields.truncate_prompt_tokens))

    async def _call(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the worker. A worker found dead (killed, out of memory) is replaced and the
        call made once more; one that dies during the call ends the request 503."""
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            pool = self._executor()
            try:
                kind, value = await loop.run_in_executor(pool, fn, *args)
                break
            except BrokenProcessPool as e:
                if self._pool is pool:
                    self._pool = None
                if attempt == 1:
                    raise ApiError.from_status(grpc.StatusCode.UNAVAILABLE, "the process that renders large chats "
                                               "stopped while reading this one; retry it") from e
                log.warning("the chat render worker had stopped; starting another")
        if kind == "invalid":
            raise InvalidRequest(*value)
        if kind == "api":
            status, message, code = value
            raise ApiError.bad_body(message, code, status)
        return value

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork would copy this process (the model, CUDA's state) and its threads' locks
            self._pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(self.tokenizer,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _with_ids(fields: RequestFields, packed: bytes) -> RequestFields:
    return replace(fields, token_ids=decode_pb2.GenerateRequest.FromString(packed).token_ids, prompt="")
