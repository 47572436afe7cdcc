"""The OpenAI-compatible HTTP API of the decode server (aiohttp, on the server's own event loop and
request core, beside gRPC's `pd.v1.Decode`).

    GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions

A request is read into `RequestFields` (openai_schema.py), checked by the same `RequestParser` as
a gRPC one, accepted by `DecodeCore`, and answered from its `Generation`'s tokens: one SSE event a
token when streamed (built from fragments made once a request), one JSON body otherwise. Its
endings map onto HTTP as the gRPC statuses do (STATUS below), in OpenAI's error body; an error
after the stream began is an SSE `error` event before `data: [DONE]`. A client that disconnects
cancels its handler (aiohttp's handler_cancellation), and its KV goes back as on gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import grpc
from aiohttp import web

from decode_server.core import DecodeCore, Generation, Request
from decode_server.http_request import (
    HEADER_TIMEOUT_S,
    PARSE_IN_THREAD_BYTES,
    ApiError,
    ClientErrorLog,
    default_max_body_bytes,
    openai_errors,
    parse_body,
    read_body,
    request_id_header,
)
from decode_server.openai_events import ChunkFormat
from decode_server.openai_logprobs import LogprobFormat
from decode_server.openai_schema import CHAT_NAMES, OPENAI_NAMES, ApiRequest, read_request
from decode_server.openai_tools import Tools, family_of, parse_calls, tool_call_event
from decode_server.request_parser import MAX_PROMPT_CHARS_PER_TOKEN, TOKENIZE_IN_THREAD_CHARS, RequestParser
from decode_server.sequence import Rejected
from engine.tokenizer import ChatTemplateError, StopMatcher, StreamDetokenizer, Tokenizer
from serving.grpc_common import FATAL_GRACE_S, StartupError
from serving.token_ids import TokenIds, as_array
from serving.validation import InvalidRequest

log = logging.getLogger(__name__)

FINISH_REASON = {"length": "length", "eos": "stop", "stop": "stop"}  # ours -> OpenAI's
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
# A request that fits the context holds at most about this many JSON values: a token id each, or a
# message (an object and two strings) each, beside its other fields.
MAX_VALUES_PER_TOKEN, MAX_VALUES_ELSE = 3, 4096
RENDER_IN_THREAD_MESSAGES = 16  # chats of more messages are rendered off the event loop


@dataclass
class Answer:
    """What a request produced: its text, token count and OpenAI finish reason."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    chars: int = 0  # of text produced so far, streamed or not


class OpenAIApi:
    def __init__(self, core: DecodeCore, parser: RequestParser, model_name: str, timeout_s: float,
                 ignore_unknown_fields: bool = False, max_body_bytes: int | None = None) -> None:
        self.core, self.parser, self.tokenizer = core, parser, parser.tokenizer
        self.model_name, self.max_model_len, self.timeout_s = model_name, parser.max_model_len, timeout_s
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.max_model_len)
        self.ignore_unknown_fields = ignore_unknown_fields
        self.refusals = ClientErrorLog()
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None

    # --- the application ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[openai_errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        """Listen on host:port; a port in use is one StartupError line."""
        # after the drain, what is left is cancelled within a second (as gRPC's server.stop grace); a
        # connection whose headers have not all come within HEADER_TIMEOUT_S of its opening (or of its
        # last answer) is closed, so a client that trickles them in can't hold it
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=FATAL_GRACE_S, keepalive_timeout=HEADER_TIMEOUT_S,
                                     auto_decompress=False)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        except OSError as e:
            await self._runner.cleanup()
            raise StartupError(f"can't serve HTTP on {host}:{port} ({e.strerror}); stop the other process or pass "
                               "another --http-port (0 turns HTTP off)") from e

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- routes -------------------------------------------------------------------------------
    async def health(self, _: web.Request) -> web.Response:
        try:
            self.core.check_open()
        except Rejected as e:
            return ApiError.from_status(e.code, str(e)).response()
        return web.json_response({"status": "ok"})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "pd-serve",
            "max_model_len": self.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    # --- one request --------------------------------------------------------------------------
    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s if self.timeout_s else None
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            request_id = request_id_header(request) or request_id
            api, parsed, generation = await self._accept(request, chat, request_id, arrival)
        except ApiError as e:
            self.core.log_rejected(request_id, e.grpc_code, arrival)
            if e.status < 500:
                self.refusals.refused(request_id, e)
            return e.response()
        if api.n > 1:
            return await self._choices(request, api, parsed, generation, deadline)
        reply = Reply(request, api, ChunkFormat(request_id, chat, int(time.time()), self.model_name), self.tokenizer)
        status = "OK"
        try:
            async with asyncio.timeout_at(deadline):
                return await reply.run(generation)
        except Rejected as e:
            status = e.code.name
            return await reply.fail(ApiError.from_status(e.code, str(e)))
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            return await reply.fail(ApiError.from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the request ran past --http-timeout-s {self.timeout_s:g}"))
        except asyncio.CancelledError:
            status = "CANCELLED"  # the client went away (aiohttp cancels the handler)
            raise
        except ConnectionError:  # ... or it went away while an event was being written to it
            status = "CANCELLED"
            return reply.stream or web.Response(status=499)
        except Exception as e:
            status = "INTERNAL"
            log.exception("request %s failed", request_id)
            return await reply.fail(ApiError.internal(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self.core.finish(generation, status)

    async def _choices(self, request: web.Request, api: ApiRequest, parsed: Request, first: Generation,
                       deadline: float | None) -> web.StreamResponse:
        """n > 1 (not streamed): the first choice runs alone until its first token, by when its prompt's
        full blocks are in the prefix cache; then the others are accepted and take them from there, so
        the prompt is not prefilled n times. Choice i samples with the request's seed + i."""
        fmt = ChunkFormat(parsed.request_id, api.chat, int(time.time()), self.model_name)
        replies = [Reply(request, api, fmt, self.tokenizer) for _ in range(api.n)]
        generations, tasks, status = [first], [], "OK"
        try:
            async with asyncio.timeout_at(deadline):
                replies[0].first_token = asyncio.Event()
                tasks.append(asyncio.create_task(replies[0].collect(first)))
                seen = asyncio.create_task(replies[0].first_token.wait())
                await asyncio.wait([tasks[0], seen], return_when=asyncio.FIRST_COMPLETED)
                seen.cancel()
                for i in range(1, api.n):
                    sampling = replace(parsed.sampling, seed=parsed.sampling.seed + i)
                    generations.append(self.core.accept(replace(parsed, request_id=f"{parsed.request_id}-{i}",
                                                                sampling=sampling)))
                    tasks.append(asyncio.create_task(replies[i].collect(generations[i])))
                answers = await asyncio.gather(*tasks)
        except Rejected as e:
            status = e.code.name
            return ApiError.from_status(e.code, str(e)).response()
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            return ApiError.from_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"the request ran past --http-timeout-s {self.timeout_s:g}").response()
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception as e:
            status = "INTERNAL"
            log.exception("request %s failed", parsed.request_id)
            return ApiError.internal(f"internal error: {type(e).__name__}: {e}").response()
        finally:
            for task in tasks:
                task.cancel()
            for generation in generations:
                self.core.finish(generation, status)
        prompt_tokens = len(parsed.prompt)
        completion_tokens = sum(a.tokens for a in answers)
        return web.json_response({
            "id": parsed.request_id, "object": "chat.completion" if api.chat else "text_completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [reply.choice(answer, i) for i, (reply, answer) in enumerate(zip(replies, answers,
                                                                                         strict=True))],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})

    async def _accept(self, request: web.Request, chat: bool, request_id: str,
                      arrival: float) -> tuple[ApiRequest, Request, Generation]:
        """Read, check and accept a request; every refusal is an ApiError."""
        try:
            self.core.check_open()
            api = await self._read(request, chat, request_id)
            if api.model is not None and api.model != self.model_name:
                raise ApiError(404, f"the model {api.model!r} does not exist; this server serves "
                                    f"{self.model_name!r} (GET /v1/models)", "invalid_request_error",
                               "model_not_found", "model", grpc.StatusCode.NOT_FOUND)
            fields = api.fields
            if chat:
                fields = replace(fields, prompt=await self._render(api.messages, api.tools), add_special_tokens=False)
            parsed = await self.parser.parse(fields, arrival, CHAT_NAMES if chat else OPENAI_NAMES)
            return api, parsed, self.core.accept(parsed)
        except Rejected as e:
            raise ApiError.from_status(e.code, str(e)) from e
        except InvalidRequest as e:
            raise ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from e
        except ApiError:
            raise
        except Exception as e:  # e.g. a tokenizer that chokes on some text: still one clear answer
            log.exception("request %s: reading the request failed", request_id)
            raise ApiError.internal(f"reading the request failed: {type(e).__name__}: {e}") from e

    async def _read(self, request: web.Request, chat: bool, request_id: str) -> ApiRequest:
        """The body into an ApiRequest; a large one is parsed and checked off the event loop."""
        raw = await read_body(request, self.max_body_bytes)
        data = await parse_body(raw, MAX_VALUES_PER_TOKEN * self.max_model_len + MAX_VALUES_ELSE)

        def read() -> tuple[ApiRequest, list[str]]:
            return read_request(data, chat, request_id, self.max_model_len, self.ignore_unknown_fields)

        api, unknown = await asyncio.to_thread(read) if len(raw) > PARSE_IN_THREAD_BYTES else read()
        if unknown:
            self.refusals.warn(request_id, f"took it without the unknown fields {', '.join(map(repr, unknown))} "
                                           "(--ignore-unknown-fields)")
        return api

    async def _render(self, messages: list[dict[str, Any]], tools: Tools | None) -> str:
        if self.tokenizer is None:
            raise InvalidRequest("this server's model has no tokenizer, so it can't take chats; use "
                                 "/v1/completions with a prompt of token ids", "messages")
        if tools is not None and family_of(self.tokenizer.chat_template) is None:
            raise InvalidRequest("this model's chat template takes no tools (or no known tool-call format: hermes, "
                                 "Llama 3 JSON); leave tools out", "tools")
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN:
            raise InvalidRequest(f"messages of {chars} characters can't fit the context limit of "
                                 f"{self.max_model_len} tokens", "messages")
        try:
            if chars > TOKENIZE_IN_THREAD_CHARS or len(messages) > RENDER_IN_THREAD_MESSAGES:
                return await asyncio.to_thread(self.tokenizer.render_chat, messages, tools.tools if tools else None)
            return self.tokenizer.render_chat(messages, tools.tools if tools else None)
        except ChatTemplateError as e:
            raise InvalidRequest(str(e), "messages") from e


class Reply:
    """Answers one accepted request: SSE events as its tokens come, or one JSON body at the end.
    The stream's headers go out with the first token, so a refusal before it (a full KV pool, a
    failed prefill) is still a plain HTTP status."""

    def __init__(self, request: web.Request, api: ApiRequest, fmt: ChunkFormat, tokenizer: Tokenizer | None) -> None:
        self.request, self.api, self.fmt = request, api, fmt
        self.tokenizer = tokenizer
        self.detok = StreamDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopMatcher(api.stop) if api.stop else None
        self.stream: web.StreamResponse | None = None
        self.prompt_tokens = 0
        self.logprobs = LogprobFormat(tokenizer, api.chat) if api.fields.logprobs is not None else None
        self.first_token: asyncio.Event | None = None  # set once the first token is in, when given

    async def run(self, generation: Generation) -> web.StreamResponse:
        return await self._close(await self.collect(generation))

    async def collect(self, generation: Generation) -> Answer:
        """Its tokens, streamed as they come when asked to be, and what they made."""
        answer = Answer()
        seq = generation.seq
        self.prompt_tokens = len(seq.prompt)
        async with aclosing(generation.run()) as tokens:
            async for out in tokens:
                if self.first_token is not None:
                    self.first_token.set()
                if self.api.echo and out.index == 0:  # the prompt's log probabilities are in by its first token
                    answer.text = self._prompt_text(seq.prompt)
                    answer.chars = len(answer.text)
                    if self.logprobs is not None:
                        self.logprobs.add_prompt(as_array(seq.prompt).tolist(), seq.prompt_logprob_values)
                piece = self.detok.step(out.token_id) if self.detok is not None else ""
                answer.tokens += 1
                finish = FINISH_REASON.get(out.finish_reason)
                if self.stops is not None:
                    piece, stopped = self.stops.feed(piece)
                    if stopped:
                        finish = "stop"
                    elif finish:
                        piece += self.stops.flush()
                logprobs = None
                if self.logprobs is not None and out.logprobs is not None:
                    logprobs = self.logprobs.add(out.token_id, out.logprobs, answer.chars)
                answer.chars += len(piece)
                if self.api.stream and self.api.tools is None:
                    await self._send(piece, finish, logprobs)
                else:
                    answer.text += piece
                if finish:
                    answer.finish_reason = finish
                    break
        return answer

    def _prompt_text(self, prompt: TokenIds) -> str:
        if self.api.fields.prompt:
            return self.api.fields.prompt
        return self.tokenizer.decode(as_array(prompt).tolist()) if self.tokenizer is not None else ""

    async def _open(self) -> web.StreamResponse:
        self.stream = web.StreamResponse(headers=SSE_HEADERS)
        await self.stream.prepare(self.request)
        return self.stream

    async def _send(self, piece: str, finish: str | None, logprobs: dict[str, Any] | None) -> None:
        first = self.stream is None
        stream = await self._open() if self.stream is None else self.stream
        await stream.write(self.fmt.token(piece, finish, first, None if logprobs is None else json.dumps(logprobs)))

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    async def _close(self, answer: Answer) -> web.StreamResponse:
        usage = self._usage(answer.tokens)
        if self.api.stream and self.api.tools is not None:  # tool calls are parsed once the answer is whole
            await self._send_tools(answer)
        if self.stream is not None:
            if self.api.include_usage:
                await self.stream.write(self.fmt.usage(usage))
            await self.stream.write(DONE)
            await self.stream.write_eof()
            return self.stream
        return web.json_response({
            "id": self.fmt.request_id, "object": "chat.completion" if self.api.chat else "text_completion",
            "created": int(time.time()), "model": self.fmt.model, "choices": [self.choice(answer)], "usage": usage})

    def choice(self, answer: Answer, index: int = 0) -> dict[str, Any]:
        """The answer as a non-streamed response's choice."""
        choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs.whole() if self.logprobs else None,
                                  "finish_reason": answer.finish_reason}
        if self.api.chat:
            content, calls = self._tool_calls(answer)
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choice["finish_reason"] = "tool_calls" if calls else answer.finish_reason
        else:
            choice["text"] = answer.text
        return choice

    def _tool_calls(self, answer: Answer) -> tuple[str | None, list[dict[str, Any]]]:
        template = self.tokenizer.chat_template if self.tokenizer is not None else ""
        return parse_calls(answer.text, self.api.tools, family_of(template)) if self.api.tools else (answer.text, [])

    async def _send_tools(self, answer: Answer) -> None:
        content, calls = self._tool_calls(answer)
        first, stream = self.stream is None, self.stream or await self._open()
        await stream.write(tool_call_event(self.fmt.request_id, self.fmt.model, calls, content, first) if calls
                           else self.fmt.token(answer.text, answer.finish_reason, first))

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """The request's error: its HTTP status before the stream began, an SSE event after."""
        if self.stream is None:
            return error.response()
        try:
            await self.stream.write(f"data: {json.dumps(error.body())}\n\n".encode())
            await self.stream.write(DONE)
            await self.stream.write_eof()
        except ConnectionError:
            pass  # the client is gone too; there is no one left to tell
        return self.stream
