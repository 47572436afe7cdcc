"""gRPC service `pd.v1.Decode`: validate, admit, get the prompt prefilled, stream the tokens.

Every way a request can end is one gRPC status (DESIGN.md's reliability contract):
INVALID_ARGUMENT for a bad request, ALREADY_EXISTS for a request_id in flight, RESOURCE_EXHAUSTED
past the admission limits, UNAVAILABLE when the prefill server or this server's engine fails or
the server is draining, CANCELLED / DEADLINE_EXCEEDED when the client gives up. Whatever the
ending, the request's KV blocks go back to the pool (here, or on the engine thread once it owns
them) and one JSON line goes to the `decode_server.requests` log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from pd.v1 import decode_pb2, decode_pb2_grpc

from decode_server import metrics
from decode_server.config import MODE_NUMBERS, DecodeConfig
from decode_server.engine import DecodeEngine
from decode_server.prefill_client import PrefillFailed, PrefillRouter
from decode_server.sequence import ErrorEvent, Event, Sequence, TokenEvent
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.tokenizer import StreamDetokenizer, Tokenizer
from serving.grpc_common import StatusError, deadline_passed
from serving.validation import InvalidRequest, check_lengths, check_max_new_tokens, check_token_ids

log = logging.getLogger(__name__)
request_log = logging.getLogger("decode_server.requests")

MODE_NAMES = {number: name for name, number in MODE_NUMBERS.items()}
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_CHARS_PER_TOKEN = 64   # text longer than this many characters per context token can't fit
TOKENIZE_IN_THREAD_CHARS = 16384  # longer prompts are tokenized off the event loop


class Rejected(StatusError):
    """Ends the Generate stream with its status."""


@dataclass
class _KVWaiter:
    seq: Sequence
    need: int
    admitted: asyncio.Future[None]


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, runner: ModelRunner, engine: DecodeEngine, tokenizer: Tokenizer | None,
                 router: PrefillRouter | None) -> None:
        self.cfg, self.runner, self.engine, self.tokenizer, self.router = cfg, runner, engine, tokenizer, router
        self.in_flight: set[str] = set()
        self.kv_waiters: deque[_KVWaiter] = deque()  # FIFO: requests waiting for KV blocks
        self.waiting_tokens = 0                         # their token budget
        self.remote_prefills = 0                        # requests in a remote prefill now
        self.draining = False
        self.eos_ids = frozenset(runner.config.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer else ())

    @property
    def waiting_for_kv(self) -> int:
        return len(self.kv_waiters)

    def num_waiting(self) -> int:
        """Accepted, not yet decoding: waiting for KV, in remote prefill, or queued in the engine."""
        return self.waiting_for_kv + self.remote_prefills + self.engine.num_waiting

    def start_draining(self) -> None:
        """SIGTERM: new requests get UNAVAILABLE; those in flight carry on."""
        self.draining = True

    # --- validation ---------------------------------------------------------------------------
    async def _parse(self, request: decode_pb2.GenerateRequest) -> tuple[list[int], SamplingParams, str, int]:
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
        if has_ids:
            check_lengths(len(request.token_ids), request.max_new_tokens, limit)
            tokens = list(request.token_ids)
        else:
            if self.tokenizer is None:
                raise InvalidRequest("this server's model has no tokenizer, so it can't take prompt text; "
                                     "send token_ids")
            if len(request.prompt) > limit * MAX_PROMPT_CHARS_PER_TOKEN:
                raise InvalidRequest(f"prompt text of {len(request.prompt)} characters can't fit the context "
                                     f"limit of {limit} tokens (at most {limit * MAX_PROMPT_CHARS_PER_TOKEN} "
                                     "characters are accepted)")
            if len(request.prompt) > TOKENIZE_IN_THREAD_CHARS:
                tokens = await asyncio.to_thread(self.tokenizer.encode, request.prompt)
            else:
                tokens = self.tokenizer.encode(request.prompt)
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
        if request.prefill_mode not in (0, *MODE_NAMES):
            raise InvalidRequest(f"unknown prefill_mode {request.prefill_mode}; use one of 0-{max(MODE_NAMES)}")
        mode = MODE_NAMES.get(request.prefill_mode, self.cfg.default_mode)
        if mode == "disaggregated" and self.router is None:
            raise InvalidRequest("disaggregated prefill needs a prefill server; this decode server was started "
                                 "without --prefill-addr")
        if request.chunk_size < 0:
            raise InvalidRequest(f"chunk_size must be >= 0 (0 = the server's --chunk-size), got {request.chunk_size}")
        return tokens, params, mode, request.chunk_size or self.cfg.chunk_size

    # --- admission ----------------------------------------------------------------------------
    async def _reserve_blocks(self, seq: Sequence) -> None:
        """Reserve every block the request can need (prompt + max_new_tokens), first come first served.

        Past --max-queued-requests waiters or --max-waiting-tokens of their tokens, refuse at once."""
        allocator = self.runner.pool.allocator
        need = self.runner.pool.blocks_needed(seq.total_tokens)
        if need > allocator.num_blocks:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the request needs {need} KV blocks, the whole pool has {allocator.num_blocks}")
        if not self.kv_waiters and allocator.num_free >= need:
            seq.block_table = allocator.allocate(need)
            return
        if self.waiting_for_kv >= self.cfg.max_queued_requests:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full ({allocator.num_free} of {allocator.num_blocks} blocks free, this "
                           f"request needs {need}) and {self.waiting_for_kv} requests already wait "
                           f"(--max-queued-requests {self.cfg.max_queued_requests})")
        if self.waiting_tokens + seq.total_tokens > self.cfg.max_waiting_tokens:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full and waiting requests hold {self.waiting_tokens} tokens; this one's "
                           f"{seq.total_tokens} would pass --max-waiting-tokens {self.cfg.max_waiting_tokens}")
        waiter = _KVWaiter(seq, need, asyncio.get_running_loop().create_future())
        self.kv_waiters.append(waiter)
        self.waiting_tokens += seq.total_tokens
        try:
            await waiter.admitted  # the blocks are in seq.block_table once this resolves
        finally:
            self.waiting_tokens -= seq.total_tokens
            if waiter in self.kv_waiters:
                self.kv_waiters.remove(waiter)
                self._admit_waiters()  # this one may have been the head of the queue

    def _admit_waiters(self) -> None:
        """Hand freed blocks to the waiting requests in arrival order (on the event loop)."""
        allocator = self.runner.pool.allocator
        while self.kv_waiters:
            head = self.kv_waiters[0]
            if head.admitted.done():
                self.kv_waiters.popleft()
                continue
            if allocator.num_free < head.need:
                return
            head.seq.block_table = allocator.allocate(head.need)
            head.admitted.set_result(None)
            self.kv_waiters.popleft()

    def notify_blocks_freed(self) -> None:
        """Called on the event loop whenever blocks go back to the pool."""
        self._admit_waiters()

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
                self._log_rejected("", grpc.StatusCode.INVALID_ARGUMENT, arrival)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed GenerateRequest: {e}")
        assert isinstance(request, decode_pb2.GenerateRequest)
        request_id = request.request_id or uuid.uuid4().hex
        if self.draining:
            self._log_rejected(request_id, grpc.StatusCode.UNAVAILABLE, arrival)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode server is shutting down; retry on another "
                                                             "replica")
        if self.engine.failed is not None:
            self._log_rejected(request_id, grpc.StatusCode.UNAVAILABLE, arrival)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode engine has failed; the server is exiting")
        try:
            tokens, params, mode, chunk_size = await self._parse(request)
        except InvalidRequest as e:
            self._log_rejected(request_id, grpc.StatusCode.INVALID_ARGUMENT, arrival)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # e.g. a tokenizer that chokes on some text: still one clear status
            log.exception("request %s: reading the request failed", request_id)
            self._log_rejected(request_id, grpc.StatusCode.INTERNAL, arrival)
            await context.abort(grpc.StatusCode.INTERNAL, f"reading the request failed: {type(e).__name__}: {e}")
        if request_id in self.in_flight:
            self._log_rejected(request_id, grpc.StatusCode.ALREADY_EXISTS, arrival)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        self.in_flight.add(request_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        seq = Sequence(request_id, tokens, request.max_new_tokens, params, frozenset(request.stop_token_ids),
                       frozenset() if request.ignore_eos else self.eos_ids, mode, chunk_size,
                       emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        seq.timing.arrival = arrival
        # However the call ends (even with this generator parked at a `yield`), the engine lets go.
        context.add_done_callback(lambda _: seq.cancelled.set())
        status = "OK"
        try:
            async for response in self._run(seq, events):
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
            seq.cancelled.set()
            if not seq.in_engine and seq.block_table:
                seq.release(self.runner.pool.allocator)
            self.in_flight.discard(request_id)
            self._log_finished(seq, status)

    async def _run(self, seq: Sequence, events: asyncio.Queue[Event]) -> AsyncIterator[decode_pb2.GenerateResponse]:
        timing = seq.timing
        await self._reserve_blocks(seq)
        timing.admitted = time.perf_counter()
        metrics.QUEUE_TIME.observe(timing.admitted - timing.arrival)
        if seq.mode == "disaggregated":
            await self._remote_prefill(seq)
            if not seq.finish_reason:
                self.engine.submit(seq)
        else:
            self.engine.submit(seq)
        detok = StreamDetokenizer(self.tokenizer) if self.tokenizer else None
        last = timing.arrival
        while True:
            event = await events.get()
            if isinstance(event, ErrorEvent):
                raise Rejected(event.code, event.message)
            assert isinstance(event, TokenEvent)
            now = time.perf_counter()
            if event.index == 0:
                metrics.TTFT.observe(now - timing.arrival)
            else:
                metrics.ITL.observe(now - last)
            last = now
            yield decode_pb2.GenerateResponse(
                token_id=event.token_id, index=event.index, text=detok.step(event.token_id) if detok else "",
                finish_reason=event.finish_reason, request_id=seq.request_id,
                timing=decode_pb2.ServerTiming(
                    queue_s=timing.admitted - timing.arrival, prefill_s=timing.prefill_s,
                    kv_transfer_s=timing.kv_transfer_s, first_token_s=timing.first_token - timing.arrival,
                    decode_step_s=event.step_s, since_arrival_s=now - timing.arrival, kv_bytes=timing.kv_bytes,
                    kv_exposed_s=timing.kv_exposed_s, kv_transport=timing.kv_transport,
                    prefill_queue_s=timing.prefill_queue_s))
            if event.finish_reason:
                metrics.E2E.observe(now - timing.arrival)
                metrics.REQUEST_SUCCESS.labels(event.finish_reason).inc()
                return

    async def _remote_prefill(self, seq: Sequence) -> None:
        """Prefill on a prefill server; its KV lands in this request's blocks.

        A failure that a second try may cure is retried once, with the same blocks: after
        UNAVAILABLE or FAILED_PRECONDITION the router has dropped the pairing, so the retry
        handshakes afresh (and may pick another prefill server). That covers a prefill server that
        restarted while this one was idle: it answers the stale pairing with "handshake first". A
        server that is down, or a real layout mismatch, fails the retry the same way at once."""
        assert self.router is not None  # checked in _parse
        timing = seq.timing
        blocks = list(seq.block_table)
        self.remote_prefills += 1
        try:
            for attempt in range(2):
                try:
                    remote = await self.router.prefill(seq.request_id, seq.prompt, self._sampling_proto(seq),
                                                       seq.block_table)
                    break
                except PrefillFailed as e:
                    retry = (attempt == 0 and seq.block_table == blocks  # blocks not held back by the router
                             and e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION))
                    if not retry:
                        raise Rejected(e.code, str(e)) from e
                    log.info("request %s: %s; retrying once with a fresh handshake", seq.request_id, e)
        finally:
            self.remote_prefills -= 1
        timing.prefill_s, timing.kv_transfer_s = remote.prefill_s, remote.kv_transfer_s
        timing.prefill_queue_s, timing.kv_start_at_s, timing.kv_post_s = remote.queue_s, remote.start_at_s, \
            remote.post_s
        timing.kv_post_busy_s = remote.post_busy_s
        timing.kv_exposed_s, timing.kv_bytes, timing.kv_transport = remote.kv_exposed_s, remote.kv_bytes, \
            remote.transport
        metrics.PREFILL_SECONDS.observe(remote.prefill_s)
        metrics.KV_TRANSFER_SECONDS.observe(remote.kv_transfer_s)
        metrics.KV_TRANSFER_BYTES.labels(remote.transport).inc(remote.kv_bytes)
        seq.append(remote.first_token, time.perf_counter() - timing.admitted)

    @staticmethod
    def _sampling_proto(seq: Sequence) -> decode_pb2.SamplingParams:
        p = seq.params
        return decode_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)

    # --- the record of each request -------------------------------------------------------------
    def _log_rejected(self, request_id: str, code: grpc.StatusCode, arrival: float) -> None:
        """A request refused before it was accepted: counted and logged like any other ending."""
        metrics.REQUEST_FAILURE.labels(code.name).inc()
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": request_id, "status": code.name, "finish_reason": "",
            "mode": None, "prompt_tokens": None, "output_tokens": 0, "queue_s": 0.0, "prefill_s": 0.0,
            "kv_transfer_s": 0.0, "ttft_s": None, "e2e_s": round(time.perf_counter() - arrival, 6)}))

    def _log_finished(self, seq: Sequence, status: str) -> None:
        if status != "OK":
            metrics.REQUEST_FAILURE.labels(status).inc()
        self._admit_waiters()
        t = seq.timing
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": seq.request_id, "status": status,
            "finish_reason": seq.finish_reason, "mode": seq.mode, "prompt_tokens": len(seq.prompt),
            "output_tokens": len(seq.output), "queue_s": round(max(0.0, t.admitted - t.arrival), 6),
            "prefill_queue_s": round(t.prefill_queue_s, 6), "prefill_s": round(t.prefill_s, 6),
            "kv_transfer_s": round(t.kv_transfer_s, 6), "kv_exposed_s": round(t.kv_exposed_s, 6),
            "kv_start_at_s": round(t.kv_start_at_s, 6), "kv_post_s": round(t.kv_post_s, 6),
            "kv_post_busy_s": round(t.kv_post_busy_s, 6),
            "ttft_s": round(t.first_token - t.arrival, 6) if t.first_token else None,
            "e2e_s": round(time.perf_counter() - t.arrival, 6)}))


def add_to_server(service: DecodeService, server: grpc.aio.Server) -> None:
    """Register `pd.v1.Decode` with Generate taking raw bytes (parsed, and refused cleanly, in Generate)."""
    handler = grpc.method_handlers_generic_handler("pd.v1.Decode", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=None,
            response_serializer=decode_pb2.GenerateResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((handler,))
