"""gRPC service `pd.v1.Decode`: validate, admit, get the prompt prefilled, stream the tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from pd.v1 import decode_pb2, decode_pb2_grpc

from decode_server import metrics
from decode_server.config import DecodeConfig
from decode_server.engine import DecodeEngine
from decode_server.prefill_client import PrefillFailed, PrefillRouter
from decode_server.sequence import ErrorEvent, Event, Sequence, TokenEvent
from engine.kv_cache import OutOfBlocks
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.tokenizer import StreamDetokenizer, Tokenizer
from engine.validation import InvalidRequest, check_lengths, check_token_ids

log = logging.getLogger(__name__)
request_log = logging.getLogger("decode_server.requests")

MODE_NAMES = {
    decode_pb2.PREFILL_MODE_DISAGGREGATED: "disaggregated",
    decode_pb2.PREFILL_MODE_COLOCATED: "colocated",
    decode_pb2.PREFILL_MODE_CHUNKED: "chunked",
}


class Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, cfg: DecodeConfig, runner: ModelRunner, engine: DecodeEngine, tokenizer: Tokenizer | None,
                 router: PrefillRouter | None) -> None:
        self.cfg, self.runner, self.engine, self.tokenizer, self.router = cfg, runner, engine, tokenizer, router
        self.in_flight: set[str] = set()
        self.waiting_for_kv = 0            # requests queued for KV blocks
        self.waiting_tokens = 0            # their token budget
        self._blocks_freed = asyncio.Condition()
        self.eos_ids = frozenset(runner.config.eos_token_ids) | frozenset(
            tokenizer.eos_token_ids if tokenizer else ())

    # --- validation ---------------------------------------------------------------------------
    def _parse(self, request: decode_pb2.GenerateRequest) -> tuple[list[int], SamplingParams, str, int]:
        has_text, has_ids = bool(request.prompt), len(request.token_ids) > 0
        if has_text == has_ids:
            raise InvalidRequest("set exactly one of prompt (text) and token_ids" if has_text
                                 else "the request has no prompt: set prompt (text) or token_ids")
        if has_text:
            if self.tokenizer is None:
                raise InvalidRequest("this server has no tokenizer (random-weight preset); send token_ids")
            tokens = self.tokenizer.encode(request.prompt)
        else:
            tokens = list(request.token_ids)
        check_token_ids(tokens, self.runner.config.vocab_size)
        check_lengths(len(tokens), request.max_new_tokens, self.runner.max_model_len)
        for position, token in enumerate(request.stop_token_ids):
            if not 0 <= token < self.runner.config.vocab_size:
                raise InvalidRequest(f"stop_token_ids[{position}] = {token} is outside the vocabulary "
                                     f"[0, {self.runner.config.vocab_size})")
        s = request.sampling
        try:
            params = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed or random.getrandbits(62))
        except ValueError as e:
            raise InvalidRequest(f"bad sampling parameters: {e}") from e
        mode = MODE_NAMES.get(request.prefill_mode, self.cfg.default_mode)
        if request.prefill_mode not in (0, *MODE_NAMES):
            raise InvalidRequest(f"unknown prefill_mode {request.prefill_mode}")
        if mode == "disaggregated" and self.router is None:
            raise InvalidRequest("disaggregated prefill needs a prefill server; this decode server was started "
                                 "without --prefill-addr")
        if request.chunk_size < 0:
            raise InvalidRequest(f"chunk_size must be >= 0, got {request.chunk_size}")
        return tokens, params, mode, request.chunk_size or self.cfg.chunk_size

    # --- admission ----------------------------------------------------------------------------
    async def _reserve_blocks(self, seq: Sequence, context: grpc.aio.ServicerContext) -> None:
        pool = self.runner.pool
        need = pool.blocks_needed(seq.total_tokens)
        if need > pool.allocator.num_blocks:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the request needs {need} KV blocks, the whole pool has {pool.allocator.num_blocks}")
        try:
            seq.block_table = pool.allocator.allocate(need)
            return
        except OutOfBlocks:
            pass
        if self.waiting_for_kv >= self.cfg.max_queued_requests:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full and {self.waiting_for_kv} requests already wait "
                           f"(--max-queued-requests {self.cfg.max_queued_requests})")
        if self.waiting_tokens + seq.total_tokens > self.cfg.max_waiting_tokens:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full and waiting requests hold {self.waiting_tokens} tokens; this one "
                           f"({seq.total_tokens}) would pass --max-waiting-tokens {self.cfg.max_waiting_tokens}")
        self.waiting_for_kv += 1
        self.waiting_tokens += seq.total_tokens
        try:
            async with self._blocks_freed:
                while True:
                    try:
                        seq.block_table = pool.allocator.allocate(need)
                        return
                    except OutOfBlocks:
                        await self._blocks_freed.wait()
        finally:
            self.waiting_for_kv -= 1
            self.waiting_tokens -= seq.total_tokens

    def notify_blocks_freed(self) -> None:
        """Called (on the event loop) whenever a request ends, so waiting requests retry."""

        async def _notify() -> None:
            async with self._blocks_freed:
                self._blocks_freed.notify_all()

        asyncio.ensure_future(_notify())

    # --- the RPC ------------------------------------------------------------------------------
    async def Generate(self, request: decode_pb2.GenerateRequest,  # type: ignore[override]
                       context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        try:
            tokens, params, mode, chunk_size = self._parse(request)
        except InvalidRequest as e:
            metrics.REQUEST_FAILURE.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.engine.failed is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode engine has failed; the server is exiting")
        if request_id in self.in_flight:
            metrics.REQUEST_FAILURE.labels("ALREADY_EXISTS").inc()
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")
        self.in_flight.add(request_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        seq = Sequence(request_id, tokens, request.max_new_tokens, params, frozenset(request.stop_token_ids),
                       frozenset() if request.ignore_eos else self.eos_ids, mode, chunk_size,
                       emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        status = "OK"
        try:
            async for response in self._run(seq, events, context):
                yield response
        except Rejected as e:
            status = e.code.name
            await context.abort(e.code, str(e))
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            seq.cancelled.set()
            if not seq.in_engine and seq.block_table:
                seq.release(self.runner.pool.allocator)
            self.in_flight.discard(request_id)
            self._log_finished(seq, status)

    async def _run(self, seq: Sequence, events: asyncio.Queue[Event],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.GenerateResponse]:
        timing = seq.timing
        await self._reserve_blocks(seq, context)
        timing.admitted = time.perf_counter()
        metrics.QUEUE_TIME.observe(timing.admitted - timing.arrival)
        if seq.mode == "disaggregated":
            assert self.router is not None  # checked in _parse
            try:
                remote = await self.router.prefill(seq.request_id, seq.prompt, self._sampling_proto(seq),
                                                   seq.block_table)
            except PrefillFailed as e:
                raise Rejected(e.code, str(e)) from e
            timing.prefill_s, timing.kv_transfer_s = remote.prefill_s, remote.kv_transfer_s
            metrics.PREFILL_SECONDS.observe(remote.prefill_s)
            metrics.KV_TRANSFER_SECONDS.observe(remote.kv_transfer_s)
            metrics.KV_TRANSFER_BYTES.labels(remote.transport).inc(remote.kv_bytes)
            seq.append(remote.first_token, time.perf_counter() - timing.admitted)
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
                    decode_step_s=event.step_s, since_arrival_s=now - timing.arrival))
            if event.finish_reason:
                metrics.E2E.observe(now - timing.arrival)
                metrics.REQUEST_SUCCESS.labels(event.finish_reason).inc()
                return

    @staticmethod
    def _sampling_proto(seq: Sequence) -> decode_pb2.SamplingParams:
        p = seq.params
        return decode_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)

    def _log_finished(self, seq: Sequence, status: str) -> None:
        if status != "OK":
            metrics.REQUEST_FAILURE.labels(status).inc()
        self.notify_blocks_freed()
        t = seq.timing
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": seq.request_id, "status": status,
            "finish_reason": seq.finish_reason, "mode": seq.mode, "prompt_tokens": len(seq.prompt),
            "output_tokens": len(seq.output), "queue_s": round(max(0.0, t.admitted - t.arrival), 6),
            "prefill_s": round(t.prefill_s, 6), "kv_transfer_s": round(t.kv_transfer_s, 6),
            "ttft_s": round(t.first_token - t.arrival, 6) if t.first_token else None,
            "e2e_s": round(time.perf_counter() - t.arrival, 6)}))
