"""gRPC service `pd.v1.Decode`: parse and check a GenerateRequest, run it through the request
core (decode_server.core), and answer with its tokens or one status.

Every way a request can end is one gRPC status: INVALID_ARGUMENT for a bad request,
ALREADY_EXISTS for a request_id in flight, RESOURCE_EXHAUSTED past the admission limits,
UNAVAILABLE when the prefill server or this server's engine fails or the server is draining,
CANCELLED / DEADLINE_EXCEEDED when the client gives up, INTERNAL for a failure of our own. Whatever
the ending, the request's KV blocks go back to the pool and one JSON line goes to the
`decode_server.requests` log.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from pd.v1 import decode_pb2, decode_pb2_grpc

from decode_server.config import DecodeConfig, PrefillMode, chunk_size_problem
from decode_server.core import DecodeCore, Generation, Request
from decode_server.sequence import Rejected
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.tokenizer import StreamDetokenizer, Tokenizer
from serving.grpc_common import deadline_passed
from serving.token_ids import TokenIds, token_ids
from serving.validation import InvalidRequest, check_lengths, check_max_new_tokens, check_token_ids

log = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_CHARS_PER_TOKEN = 64   # text longer than this many characters per context token can't fit
TOKENIZE_IN_THREAD_CHARS = 16384  # longer prompts are tokenized off the event loop


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, runner: ModelRunner, core: DecodeCore, tokenizer: Tokenizer | None) -> None:
        self.cfg, self.runner, self.core, self.tokenizer = cfg, runner, core, tokenizer

    # --- validation ---------------------------------------------------------------------------
    async def _parse(self, request: decode_pb2.GenerateRequest, request_id: str, arrival: float) -> Request:
        """Cheap checks first, so an oversized request is refused before any per-token work."""
        limit = self.runner.max_model_len
        vocab = self.runner.config.vocab_size
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"request_id is {len(request.request_id)} characters; the limit is "
                                 f"{MAX_REQUEST_ID_CHARS}")
        has_text, has_ids = bool(request.prompt), len(request.token_ids) > 0
        if has_text == has_ids:
            raise InvalidRequest("set exactly one of prompt (text) and token_ids, not both" if has_text
                                 else "the request has no prompt: set prompt (text) or token_ids")
        check_max_new_tokens(request.max_new_tokens)
        tokens: TokenIds
        if has_ids:
            check_lengths(len(request.token_ids), request.max_new_tokens, limit)
            tokens = request.token_ids  # kept as the field it came in: no per-token work on the event loop
        else:
            if self.tokenizer is None:
                raise InvalidRequest("this server's model has no tokenizer, so it can't take prompt text; "
                                     "send token_ids")
            if len(request.prompt) > limit * MAX_PROMPT_CHARS_PER_TOKEN:
                raise InvalidRequest(f"prompt text of {len(request.prompt)} characters can't fit the context "
                                     f"limit of {limit} tokens (at most {limit * MAX_PROMPT_CHARS_PER_TOKEN} "
                                     "characters are accepted)")
            encode = self.tokenizer.encode
            if len(request.prompt) > TOKENIZE_IN_THREAD_CHARS:
                tokens = await asyncio.to_thread(lambda: token_ids(encode(request.prompt)))
            else:
                tokens = token_ids(encode(request.prompt))
            if not tokens:
                raise InvalidRequest("the prompt text encodes to no tokens")
            check_lengths(len(tokens), request.max_new_tokens, limit)
        check_token_ids(tokens, vocab)
        if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{len(request.stop_token_ids)} stop_token_ids; the limit is {MAX_STOP_TOKEN_IDS}")
        for position, token in enumerate(request.stop_token_ids):
            if not 0 <= token < vocab:
                raise InvalidRequest(f"stop_token_ids[{position}] = {token} is outside the vocabulary [0, {vocab})")
        s = request.sampling
        try:
            params = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed or random.getrandbits(62))
        except ValueError as e:
            raise InvalidRequest(f"bad sampling parameters: {e}") from e
        mode = PrefillMode.from_number(request.prefill_mode) if request.prefill_mode else self.cfg.default_mode
        if mode is None:
            raise InvalidRequest(f"unknown prefill_mode {request.prefill_mode}; use one of "
                                 f"0-{max(m.number for m in PrefillMode)}")
        problem = chunk_size_problem(request.chunk_size) if request.chunk_size else None
        if problem:
            raise InvalidRequest(f"chunk_size {problem}; or 0 for the server's --chunk-size")
        if request.prefill_sms < 0:
            raise InvalidRequest(f"prefill_sms must be >= 0 (0 = the server's --prefill-sms), got "
                                 f"{request.prefill_sms}")
        if mode == PrefillMode.PARTITIONED and request.prefill_sms:
            problem = self.core.scheduler.check_prefill_sms(request.prefill_sms)
            if problem:
                raise InvalidRequest(f"prefill_sms {problem}")
        return Request(request_id, tokens, request.max_new_tokens, params, frozenset(request.stop_token_ids),
                       request.ignore_eos, mode, request.chunk_size or self.cfg.chunk_size, arrival,
                       request.prefill_sms)

    # --- the RPC ------------------------------------------------------------------------------
    async def Generate(self, request: decode_pb2.GenerateRequest | bytes,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Registered with a raw-bytes deserializer (see `add_to_server`): a malformed message is
        INVALID_ARGUMENT here, where grpc itself would answer UNKNOWN."""
        arrival = time.perf_counter()
        if isinstance(request, bytes):
            try:
                request = decode_pb2.GenerateRequest.FromString(request)
            except DecodeError as e:
                await self._refuse(context, "", Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                                                         f"malformed GenerateRequest: {e}"), arrival)
        assert isinstance(request, decode_pb2.GenerateRequest)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            self.core.check_open()
            parsed = await self._parse(request, request_id, arrival)
            generation = self.core.accept(parsed)
        except Rejected as e:
            await self._refuse(context, request_id, e, arrival)
        except InvalidRequest as e:
            await self._refuse(context, request_id, Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)), arrival)
        except Exception as e:  # e.g. a tokenizer that chokes on some text: still one clear status
            log.exception("request %s: reading the request failed", request_id)
            await self._refuse(context, request_id, Rejected(
                grpc.StatusCode.INTERNAL, f"reading the request failed: {type(e).__name__}: {e}"), arrival)
        # However the call ends (even with this generator parked at a `yield`), the scheduler lets go.
        context.add_done_callback(lambda _: generation.cancel())
        status = "OK"
        try:
            async for response in self._responses(generation):
                yield response
        except Rejected as e:
            status = e.code.name
            await context.abort(e.code, str(e))
        except (asyncio.CancelledError, GeneratorExit):
            status = "DEADLINE_EXCEEDED" if deadline_passed(context) else "CANCELLED"
            raise
        except Exception as e:
            status = "INTERNAL"
            log.exception("request %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        finally:
            self.core.finish(generation, status)

    async def _refuse(self, context: grpc.aio.ServicerContext, request_id: str, rejected: Rejected,
                      arrival: float) -> None:
        """End a call refused before its request was accepted (abort raises)."""
        self.core.log_rejected(request_id, rejected.code, arrival)
        await context.abort(rejected.code, str(rejected))

    async def _responses(self, generation: Generation) -> AsyncIterator[decode_pb2.GenerateResponse]:
        detok = StreamDetokenizer(self.tokenizer) if self.tokenizer else None
        seq = generation.seq
        async for out in generation.tokens():
            yield decode_pb2.GenerateResponse(
                token_id=out.token_id, index=out.index, text=detok.step(out.token_id) if detok else "",
                finish_reason=out.finish_reason, request_id=seq.request_id,
                timing=seq.timing.to_proto(time.perf_counter(), out.step_s))


def add_to_server(service: DecodeService, server: grpc.aio.Server) -> None:
    """Register `pd.v1.Decode` with Generate taking raw bytes (parsed, and refused cleanly, in Generate)."""
    handler = grpc.method_handlers_generic_handler("pd.v1.Decode", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=None,
            response_serializer=decode_pb2.GenerateResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((handler,))
