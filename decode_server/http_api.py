"""The OpenAI-compatible HTTP API of the decode server (aiohttp, on the server's own event loop and
request core, beside gRPC's `pd.v1.Decode`).

    GET /v1/models, GET /health, POST /v1/completions, POST /v1/chat/completions,
    POST /tokenize, POST /detokenize (vLLM's)

A request is read into `RequestFields` (openai_schema.py), checked by the same `RequestParser` as
a gRPC one, accepted by `DecodeCore`, and answered from its `Generation`s' tokens (one a choice,
openai_reply.py): one SSE event a token when streamed (built from fragments made once a request),
one JSON body otherwise. Its endings map onto HTTP as the gRPC statuses do (STATUS below), in
OpenAI's error body; an error after the stream began is an SSE `error` event before `data: [DONE]`.
A client that disconnects cancels its handler (aiohttp's handler_cancellation), and with it every
choice; their KV goes back as on gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from dataclasses import replace
from typing import Any

import grpc
from aiohttp import web

from decode_server.chat_render_pool import POOL_BODY_BYTES, POOL_MESSAGES, ChatRenderPool, chat_text
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
from decode_server.openai_reply import DONE, Reply, SseStream
from decode_server.openai_response_events import ResponseEvents
from decode_server.openai_responses import new_id, output_of, response_object, responses_refusal, status_of
from decode_server.openai_schema import (
    CHAT_NAMES,
    OPENAI_NAMES,
    RESPONSES_NAMES,
    ApiRequest,
    read_request,
    read_responses_request,
)
from decode_server.openai_tokenize import TokenizeRequest, read_detokenize, read_tokenize, tokenize_reply
from decode_server.openai_tools import Tools
from decode_server.request_fields import RequestFields
from decode_server.request_parser import RequestParser
from decode_server.sequence import Rejected
from engine.tokenizer import ChatOptions, Tokenizer
from serving.grpc_common import FATAL_GRACE_S, StartupError
from serving.validation import InvalidRequest

log = logging.getLogger(__name__)

# A request that fits the context holds at most about this many JSON values: one a context token
# (a token id is one; a message, three, costs its template more tokens than that), beside its other
# fields (logit_bias, allowed_token_ids, tools, schemas). Every value parsed holds the GIL, so this
# bounds what a request may make the server parse while it decodes for others.
MAX_VALUES_PER_TOKEN, MAX_VALUES_ELSE = 1, 16384


class OpenAIApi:
    def __init__(self, core: DecodeCore, parser: RequestParser, model_name: str, timeout_s: float,
                 ignore_unknown_fields: bool = False, max_body_bytes: int | None = None) -> None:
        self.core, self.parser, self.tokenizer = core, parser, parser.tokenizer
        self.model_name, self.max_model_len, self.timeout_s = model_name, parser.max_model_len, timeout_s
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.max_model_len)
        self.render_pool = ChatRenderPool(self.tokenizer) if self.tokenizer is not None else None
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
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
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
        if self.render_pool is not None:
            self.render_pool.start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.render_pool is not None:
            self.render_pool.close()

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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True, responses=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """A prompt's or a chat's ids, as a generation of it would have them (openai_tokenize.py)."""
        try:
            tokenizer = self._tokenizer_for(request.path)
            raw, data = await self._body(request)
            # a long prompt's checks (its text's UTF-8, say) off the event loop, as a generation's
            req = (await asyncio.to_thread(read_tokenize, data, self.max_model_len) if len(raw) > PARSE_IN_THREAD_BYTES
                   else read_tokenize(data, self.max_model_len))
            self._check_model(req.model)
            ids = await self._token_ids(req)
            return web.json_response(tokenize_reply(ids, tokenizer, self.max_model_len, req.token_strs))
        except InvalidRequest as e:
            return ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param).response()
        except ApiError as e:
            return e.response()

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            tokenizer = self._tokenizer_for(request.path)
            model, ids = read_detokenize(await self._json(request), self.parser.vocab_size, self.max_model_len)
            self._check_model(model)
            return web.json_response({"prompt": tokenizer.decode(ids)})
        except InvalidRequest as e:
            return ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param).response()
        except ApiError as e:
            return e.response()

    def _tokenizer_for(self, path: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"this server's model has no tokenizer, so it can't serve {path}",
                           "invalid_request_error", "no_tokenizer", None, grpc.StatusCode.FAILED_PRECONDITION)
        return self.tokenizer

    @property
    def _max_values(self) -> int:
        """The JSON values a body may hold: as many as a prompt that fills the context needs."""
        return MAX_VALUES_PER_TOKEN * self.max_model_len + MAX_VALUES_ELSE

    async def _body(self, request: web.Request) -> tuple[bytes, Any]:
        """The body as read (its size decides what runs off the event loop) and parsed."""
        raw = await read_body(request, self.max_body_bytes)
        return raw, await self._parse(raw)

    async def _parse(self, raw: bytes) -> Any:
        """A large body is parsed in the render pool's process; the rest as `parse_body` does."""
        if self.render_pool is not None and len(raw) > POOL_BODY_BYTES:
            return await self.render_pool.parse(raw, self._max_values)
        return await parse_body(raw, self._max_values)

    async def _json(self, request: web.Request) -> Any:
        return (await self._body(request))[1]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "invalid_request_error", "model_not_found", "model",
                           grpc.StatusCode.NOT_FOUND)

    async def _token_ids(self, req: TokenizeRequest) -> list[int]:
        """As a generation reads its prompt: a chat through its template (in the render pool where it is
        long), text encoded by the request parser; bounded by the context."""
        fields = RequestFields(request_id="tokenize", prompt=req.prompt, add_special_tokens=req.add_special_tokens)
        if req.chat:
            fields = await self._chat_fields(fields, req.messages, req.tools, req.chat_options)
        names = CHAT_NAMES if req.chat else OPENAI_NAMES
        ids = list(fields.token_ids or await self.parser.encode_text(fields, names))
        if len(ids) > self.max_model_len:  # encoding refuses what is surely longer; this, the rest
            raise InvalidRequest(f"the {'chat' if req.chat else 'prompt'} encodes to {len(ids)} tokens, past the "
                                 f"context limit of {self.max_model_len}", names.prompt)
        return ids

    # --- one request --------------------------------------------------------------------------
    async def _generate(self, request: web.Request, chat: bool, responses: bool = False) -> web.StreamResponse:
        arrival = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.timeout_s if self.timeout_s else None
        request_id = new_id("resp") if responses else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            request_id = request_id_header(request) or request_id
            api, parsed, generation = await self._accept(request, chat, request_id, arrival, responses)
        except ApiError as e:
            self.core.log_rejected(request_id, e.grpc_code, arrival)
            if e.status < 500:
                self.refusals.refused(request_id, e)
            return e.response()
        return await self._answer(request, api, parsed, generation, deadline)

    async def _answer(self, request: web.Request, api: ApiRequest, parsed: Request, first: Generation,
                      deadline: float | None) -> web.StreamResponse:
        """The request's n choices, streamed on one SSE stream or as one JSON body. With n > 1 the first
        choice runs alone until its first token, by when its prompt's full blocks are in the prefix
        cache; then the others are accepted and take them from there, so the prompt is not prefilled n
        times. Choice i samples with the request's seed + i."""
        created = int(time.time())
        stream = SseStream(request, closing=b"" if api.responses else DONE) if api.stream else None
        events = ResponseEvents(parsed.request_id, created, self.model_name, api.responses) if api.responses else None
        replies = [Reply(api, events or ChunkFormat(parsed.request_id, api.chat, created, self.model_name, i),
                         self.tokenizer, stream) for i in range(api.n)]
        generations, tasks, status = [first], [], "OK"
        try:
            async with asyncio.timeout_at(deadline):
                tasks.append(asyncio.create_task(replies[0].collect(first)))
                if api.n > 1:
                    seen = asyncio.create_task(replies[0].first_token.wait())
                    await asyncio.wait([tasks[0], seen], return_when=asyncio.FIRST_COMPLETED)
                    seen.cancel()
                for i in range(1, api.n):
                    sampling = replace(parsed.sampling, seed=parsed.sampling.seed + i)
                    generations.append(self.core.accept(replace(parsed, request_id=f"{parsed.request_id}-{i}",
                                                                sampling=sampling)))
                    tasks.append(asyncio.create_task(replies[i].collect(generations[i])))
                answers = await asyncio.gather(*tasks)
                usage = self._usage(len(first.seq.prompt), sum(a.tokens for a in answers))
                if stream is not None and events is not None:
                    return await stream.end(events.completed(answers[0].finish_reason, usage))
                if stream is not None:
                    return await stream.end(replies[0].fmt.usage(usage) if api.include_usage else b"")
        except Rejected as e:
            status = e.code.name
            return await self._fail(stream, ApiError.from_status(e.code, str(e)))
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            return await self._fail(stream, ApiError.from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"the request ran past --http-timeout-s {self.timeout_s:g}"))
        except asyncio.CancelledError:
            status = "CANCELLED"  # the client went away (aiohttp cancels the handler)
            raise
        except ConnectionError:  # ... or it went away while an event was being written to it
            status = "CANCELLED"
            return (stream and stream.response) or web.Response(status=499)
        except Exception as e:
            status = "INTERNAL"
            log.exception("request %s failed", parsed.request_id)
            return await self._fail(stream, ApiError.internal(f"internal error: {type(e).__name__}: {e}"))
        finally:
            for task in tasks:  # every choice ends with the request (a hang-up cancels them all) ...
                task.cancel()
                task.add_done_callback(_settled)  # ... and a second choice's failure is not logged as unseen
            for generation in generations:
                self.core.finish(generation, status)
        if api.responses is not None:
            return web.json_response(response_object(
                parsed.request_id, created, self.model_name, api.responses, status_of(answers[0].finish_reason),
                output_of(replies[0].choice(answers[0])), usage))
        return web.json_response({
            "id": parsed.request_id, "object": "chat.completion" if api.chat else "text_completion",
            "created": created, "model": self.model_name,
            "choices": [reply.choice(answer) for reply, answer in zip(replies, answers, strict=True)], "usage": usage,
            **({"prompt_logprobs": replies[0].prompt_logprobs} if api.chat and api.prompt_logprobs is not None
               else {})})

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    @staticmethod
    async def _fail(stream: SseStream | None, error: ApiError) -> web.StreamResponse:
        return await stream.fail(error) if stream is not None else error.response()

    async def _accept(self, request: web.Request, chat: bool, request_id: str, arrival: float,
                      responses: bool = False) -> tuple[ApiRequest, Request, Generation]:
        """Read, check and accept a request; every refusal is an ApiError."""
        try:
            self.core.check_open()
            api = await self._read(request, chat, request_id, responses)
            self._check_model(api.model)
            fields = api.fields
            if chat and not fields.token_ids:  # not already through the template in the render pool
                fields = await self._chat_fields(fields, api.messages, api.tools, api.chat_options)
            names = RESPONSES_NAMES if responses else CHAT_NAMES if chat else OPENAI_NAMES
            parsed = await self.parser.parse(fields, arrival, names)
            return api, parsed, self.core.accept(parsed)
        except Rejected as e:
            raise ApiError.from_status(e.code, str(e)) from e
        except InvalidRequest as e:
            e = responses_refusal(e) if responses else e  # the chat's field names, as the Responses API's
            raise ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.param) from e
        except ApiError:
            raise
        except Exception as e:  # e.g. a tokenizer that chokes on some text: still one clear answer
            log.exception("request %s: reading the request failed", request_id)
            raise ApiError.internal(f"reading the request failed: {type(e).__name__}: {e}") from e

    async def _read(self, request: web.Request, chat: bool, request_id: str, responses: bool = False) -> ApiRequest:
        """The body into an ApiRequest; a large one is parsed and checked off the event loop, a large
        chat (or Responses API request) in the render pool's process."""
        raw = await read_body(request, self.max_body_bytes)
        if chat and self.render_pool is not None and len(raw) > POOL_BODY_BYTES:
            api, unknown = await self.render_pool.read_chat(raw, request_id, self.max_model_len, self._max_values,
                                                            self.ignore_unknown_fields, responses)
        else:
            data = await self._parse(raw)

            def read() -> tuple[ApiRequest, list[str]]:
                if responses:
                    return read_responses_request(data, request_id, self.max_model_len, self.ignore_unknown_fields)
                return read_request(data, chat, request_id, self.max_model_len, self.ignore_unknown_fields)

            api, unknown = await asyncio.to_thread(read) if len(raw) > PARSE_IN_THREAD_BYTES else read()
        if unknown:
            self.refusals.warn(request_id, f"took it without the unknown fields {', '.join(map(repr, unknown))} "
                                           "(--ignore-unknown-fields)")
        return api

    async def _chat_fields(self, fields: RequestFields, messages: list[dict[str, Any]], tools: Tools | None,
                           options: ChatOptions) -> RequestFields:
        """The chat's prompt through its template: its text, rendered here, or the ids of one of many
        messages, from the render pool."""
        if self.tokenizer is None:
            raise InvalidRequest("this server's model has no tokenizer, so it can't take chats; use "
                                 "/v1/completions with a prompt of token ids", "messages")
        if self.render_pool is not None and len(messages) > POOL_MESSAGES:
            return await self.render_pool.render(fields, messages, tools, options, self.max_model_len)
        return replace(fields, prompt=chat_text(self.tokenizer, messages, tools, options, self.max_model_len),
                       add_special_tokens=False)


def _settled(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
