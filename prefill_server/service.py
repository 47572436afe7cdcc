"""gRPC service `pd.v1.Prefill`: the handshake, and prefill jobs whose KV streams back."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from pd.v1 import prefill_pb2, prefill_pb2_grpc

from engine.kv_cache import OutOfBlocks
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.transport.grpc_stream import chunk_tokens_for
from engine.transport.handshake import (
    choose_transport,
    layout_from_proto,
    layout_mismatch_message,
    layout_to_proto,
    supported_transports,
)
from engine.validation import InvalidRequest, check_lengths, check_token_ids
from prefill_server import metrics
from prefill_server.config import PrefillConfig
from prefill_server.worker import PrefillJob, PrefillWorker

log = logging.getLogger(__name__)


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, cfg: PrefillConfig, runner: ModelRunner, worker: PrefillWorker) -> None:
        self.cfg, self.runner, self.worker = cfg, runner, worker
        self.server_id = uuid.uuid4().hex[:12]
        self.transports = supported_transports(runner.device) if cfg.kv_transport == "auto" else [cfg.kv_transport]
        self.in_flight = 0

    async def Handshake(self, request: prefill_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> prefill_pb2.HandshakeResponse:
        try:
            theirs = layout_from_proto(request.layout)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV layout in handshake: {e}")
        problem = layout_mismatch_message(theirs, self.runner.layout)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        transport = choose_transport("auto", self.transports, list(request.transports))
        if transport is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no KV transport in common: decode server offers {list(request.transports)}, "
                                f"prefill server {self.transports}")
        gpu = self.runner.device.index if self.runner.device.type == "cuda" else -1
        log.info("paired with decode server %s over %s", request.peer_id, transport)
        return prefill_pb2.HandshakeResponse(layout=layout_to_proto(self.runner.layout), transport=transport,
                                             server_id=self.server_id, gpu_index=gpu if gpu is not None else 0)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):  # type: ignore[override]
        tokens = list(request.token_ids)
        try:
            check_token_ids(tokens, self.runner.config.vocab_size)
            check_lengths(len(tokens), 1, self.runner.max_model_len)
            s = request.sampling
            params = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed)
        except (InvalidRequest, ValueError) as e:
            metrics.REQUESTS_TOTAL.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.transport not in ("", "grpc"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV transport {request.transport!r} was not agreed; handshake again")
        if self.worker.waiting >= self.cfg.max_queued_requests:
            metrics.REQUESTS_TOTAL.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prefill queue is full ({self.cfg.max_queued_requests} waiting)")
        pool = self.runner.pool
        try:
            table = pool.allocator.allocate(pool.blocks_needed(len(tokens)))
        except OutOfBlocks as e:
            metrics.REQUESTS_TOTAL.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill KV pool is full: {e}")
        metrics.KV_CACHE_USAGE.set(pool.usage)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[object] = asyncio.Queue()
        chunk = request.kv_chunk_tokens or chunk_tokens_for(self.runner.layout)
        job = PrefillJob(request.request_id, tokens, params, table, "grpc", chunk,
                         emit=lambda item: loop.call_soon_threadsafe(out.put_nowait, item))
        self.worker.submit(job)
        status = "OK"
        try:
            while (item := await out.get()) is not None:
                if isinstance(item, Exception):
                    status = "INTERNAL"
                    await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {item}")
                yield item
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        finally:
            job.cancelled.set()  # the worker frees the blocks once it lets go of them
            metrics.REQUESTS_TOTAL.labels(status).inc()
