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
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from pd.v1 import decode_pb2, decode_pb2_grpc

from decode_server.core import DecodeCore, Generation
from decode_server.request_fields import RequestFields
from decode_server.request_parser import RequestParser
from decode_server.sequence import Rejected
from engine.tokenizer import StreamDetokenizer
from serving.grpc_common import deadline_passed
from serving.validation import InvalidRequest

log = logging.getLogger(__name__)


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore, parser: RequestParser) -> None:
        self.core, self.parser, self.tokenizer = core, parser, parser.tokenizer

    @staticmethod
    def _fields(request: decode_pb2.GenerateRequest, request_id: str) -> RequestFields:
        s = request.sampling
        return RequestFields(request_id=request_id, token_ids=request.token_ids, prompt=request.prompt,
                             max_new_tokens=request.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                             top_k=s.top_k, seed=s.seed or None, stop_token_ids=request.stop_token_ids,
                             ignore_eos=request.ignore_eos, prefill_mode=request.prefill_mode,
                             chunk_size=request.chunk_size, prefill_sms=request.prefill_sms,
                             cache_salt=request.cache_salt)

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
            parsed = await self.parser.parse(self._fields(request, request_id), arrival)
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
        async for out in generation.run():
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
