"""gRPC service `pd.v1.Prefill`: the handshake, and prefill jobs whose KV streams back."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch
from pd.v1 import prefill_pb2, prefill_pb2_grpc
from torch.distributed import DistStoreError

from engine.kv_cache import OutOfBlocks
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.transport.base import KVSender, KVTransport, TransferCancelled
from engine.transport.grpc_stream import chunk_tokens_for
from engine.transport.grpc_wire import kv_payload_bytes
from engine.transport.handshake import (
    choose_transport,
    layout_from_proto,
    layout_mismatch_message,
    layout_to_proto,
    supported_transports,
)
from prefill_server import metrics
from prefill_server.config import PrefillConfig, PrefillFaults
from prefill_server.transports import SENDERS, NcclSenders, TransportSenders
from prefill_server.worker import Message, PrefillJob, PrefillWorker, SenderFactory
from serving.grpc_common import deadline_passed
from serving.validation import InvalidRequest, check_cache_salt, check_lengths, check_token_ids

log = logging.getLogger(__name__)

MAX_PAIRED_PEERS = 4096  # decode server instances remembered (oldest forgotten first)
# A quiet Prefill stream (queued, or prefilling with the KV going by NCCL) gets a Heartbeat this often, so the
# decode side tells a slow prompt from a frozen or cut-off server in seconds, not at the HTTP/2 keepalive.
HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class JobEnded:
    error: Exception | None  # None: the job finished (or was cancelled) and its stream ends


class StreamOutput:
    """A job's output (worker.JobOutput) for its Prefill call: what the engine thread sends is
    queued on the call's event loop, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Message | JobEnded] = asyncio.Queue()

    def send(self, message: Message) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, message)

    def end(self, error: Exception | None = None) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, JobEnded(error))

    async def next_or_heartbeat(self, backlog_tokens: Callable[[], int]) -> Message | JobEnded:
        """The job's next item, or a Heartbeat (with the server's backlog) once HEARTBEAT_S pass without one."""
        if not self._queue.empty():  # no timer (a task and a handle with wait_for) for an item already there
            return self._queue.get_nowait()
        try:
            return await asyncio.wait_for(self._queue.get(), HEARTBEAT_S)
        except TimeoutError:
            return prefill_pb2.PrefillResponse(heartbeat=prefill_pb2.Heartbeat(backlog_tokens=backlog_tokens()))


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, cfg: PrefillConfig, runner: ModelRunner, worker: PrefillWorker,
                 faults: PrefillFaults | None = None) -> None:
        self.cfg, self.runner, self.worker = cfg, runner, worker
        self.faults = faults or PrefillFaults()
        self.server_id = uuid.uuid4().hex[:12]
        self.transports = (supported_transports(runner.device) if cfg.kv_transport == "auto"
                           else [KVTransport(cfg.kv_transport)])
        self.in_flight = 0
        self.draining = False
        # peer_id -> transport agreed at its handshake; Prefill is refused to anyone not in here.
        self.paired: OrderedDict[str, str] = OrderedDict()
        self.cache = worker.cache
        self.senders: dict[KVTransport, TransportSenders] = {
            t: SENDERS[t](runner) for t in self.transports}

    def start_draining(self) -> None:
        self.draining = True

    async def Handshake(self, request: prefill_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> prefill_pb2.HandshakeResponse:
        try:
            theirs = layout_from_proto(request.layout)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV layout in handshake: {e}")
        problem = layout_mismatch_message(theirs, self.runner.layout)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        # cuda-ipc maps this process's memory: only for a peer on the same host
        offered = [t for t in request.transports if t != KVTransport.CUDA_IPC or request.host == socket.gethostname()]
        transport = choose_transport("auto", self.transports, offered)
        if transport is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no KV transport in common: decode server offers {list(request.transports)}, "
                                f"prefill server {self.transports}")
        assert transport is not None  # abort() raised otherwise
        if not request.peer_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handshake without a peer_id")
        try:
            extra = await asyncio.to_thread(self.senders[transport].pair, request.peer_id, request)
        except Exception as e:
            log.exception("setting up %s for %s failed", transport, request.peer_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill server could not set up {transport}: {e}")
        before = self.paired.get(request.peer_id)
        if before is not None and before != transport:
            self.senders[KVTransport(before)].forget(request.peer_id)
        self.paired[request.peer_id] = transport
        self.paired.move_to_end(request.peer_id)
        while len(self.paired) > MAX_PAIRED_PEERS:
            dropped, over = self.paired.popitem(last=False)
            self.senders[KVTransport(over)].forget(dropped)
        gpu = self.runner.device.index if self.runner.device.type == "cuda" else -1
        log.info("paired with decode server %s over %s", request.peer_id, transport)
        reply = prefill_pb2.HandshakeResponse(layout=layout_to_proto(self.runner.layout), transport=transport,
                                              server_id=self.server_id, gpu_index=gpu if gpu is not None else 0)
        reply.MergeFrom(extra)
        return reply

    async def Release(self, request: prefill_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.ReleaseResponse:
        """The decode side is done with a request's KV: its blocks may go (prefill_server.kv_lease)."""
        self.worker.leases.release(request.peer_id, request.request_id)
        return prefill_pb2.ReleaseResponse()

    async def Rendezvous(self, request: prefill_pb2.RendezvousRequest,
                         context: grpc.aio.ServicerContext) -> prefill_pb2.RendezvousResponse:
        """A store operation of a decode peer's NCCL pairing (engine.transport.nccl_rendezvous)."""
        try:
            nccl = self.senders.get(KVTransport.NCCL)
            if not isinstance(nccl, NcclSenders):
                raise PermissionError("this prefill server does not run KV transport nccl")
            return await asyncio.to_thread(nccl.rendezvous, request)
        except PermissionError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except DistStoreError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"NCCL rendezvous: {e}")
        raise AssertionError("unreachable: abort() raises")

    async def Prefill(  # type: ignore[override]
            self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        if self.draining:
            metrics.REQUESTS_TOTAL.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill server is shutting down")
        agreed = self.paired.get(request.peer_id, "")
        if not agreed:
            metrics.REQUESTS_TOTAL.labels("FAILED_PRECONDITION").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"peer {request.peer_id!r} has no handshake with this prefill server (it may have "
                                "restarted); call Handshake first")
        if request.transport != agreed:
            metrics.REQUESTS_TOTAL.labels("FAILED_PRECONDITION").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"KV transport {request.transport!r} was not agreed (the handshake chose {agreed!r}); "
                                "handshake again")
        try:
            check_lengths(len(request.token_ids), 1, self.runner.max_model_len)
            tokens = request.token_ids  # read with numpy, never a Python int each (serving.token_ids)
            check_token_ids(tokens, self.runner.config.vocab_size)
            if not 0 <= request.decode_cached_tokens < len(tokens):
                raise InvalidRequest(f"decode_cached_tokens is {request.decode_cached_tokens}; it must be in "
                                     f"[0, {len(tokens)}) for a {len(tokens)}-token prompt")
            check_cache_salt(request.cache_salt)
            self.senders[KVTransport(agreed)].check_request(request)
            s = request.sampling
            params = SamplingParams(s.temperature, s.top_p, s.top_k, s.seed)
        except (InvalidRequest, ValueError) as e:
            metrics.REQUESTS_TOTAL.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.worker.waiting >= self.cfg.max_queued_requests:
            metrics.REQUESTS_TOTAL.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prefill queue is full: {self.worker.waiting} prefills wait "
                                f"(--max-queued-requests {self.cfg.max_queued_requests})")
        pool = self.runner.pool
        try:
            table, cached = self.cache.acquire(tokens, pool.blocks_needed(len(tokens)), request.cache_salt)
        except OutOfBlocks as e:
            metrics.REQUESTS_TOTAL.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill KV pool is full: {e}")
        out = StreamOutput(asyncio.get_running_loop())
        chunk = request.kv_chunk_tokens or chunk_tokens_for(self.runner.layout)
        senders = self.senders[KVTransport(agreed)]
        job = PrefillJob(request.request_id, tokens, params, table, agreed, chunk, out,
                         make_sender=self._faulty_sender(senders) if self.faults.active else senders.sender,
                         peer_id=request.peer_id, kv_checksums=request.kv_checksums, cached_tokens=cached,
                         send_from=request.decode_cached_tokens, dst_block_table=list(request.dst_block_table),
                         dst_block_size=request.dst_block_size, dst_tag=request.dst_tag,
                         cache_salt=request.cache_salt, never_sent=senders.never_sent)
        try:
            senders.check_paired(request.peer_id)
        except LookupError as e:
            self.cache.release(table)
            metrics.REQUESTS_TOTAL.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.in_flight += 1
        self.worker.submit(job)
        status = "OK"
        try:
            while not isinstance(item := await out.next_or_heartbeat(lambda: self.worker.backlog_tokens), JobEnded):
                if isinstance(item, bytes):  # a pre-encoded KV chunk (engine.transport.grpc_wire)
                    metrics.KV_STREAMED_BYTES.inc(kv_payload_bytes(item))
                yield item
            if item.error is not None:
                status = "INTERNAL"
                error = item.error
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(error).__name__}: {error}")
        except (asyncio.CancelledError, GeneratorExit):
            status = "DEADLINE_EXCEEDED" if deadline_passed(context) else "CANCELLED"
            raise
        finally:
            job.cancelled.set()  # the worker frees the blocks once it lets go of them
            self.in_flight -= 1
            metrics.REQUESTS_TOTAL.labels(status).inc()

    def _faulty_sender(self, senders: TransportSenders) -> SenderFactory:
        """The transport's own sender, with the faults asked for (PrefillFaults): a pause before each layer's
        KV, a bit flipped in the pool once the first layer's KV is sent (before its checksum is taken, so
        what the decode side got differs from what the prefill server checksummed)."""
        return lambda job, slots: self._faulty(job, slots, senders.sender(job, slots))

    def _faulty(self, job: PrefillJob, slots: torch.Tensor, sender: KVSender) -> KVSender:
        faults, pool = self.faults, self.runner.pool

        class Faulty(KVSender):
            cancellable = sender.cancellable

            def layer_done(self, layer: int) -> None:
                time.sleep(faults.layer_delay_s)
                if job.cancelled.is_set() and sender.cancellable:
                    raise TransferCancelled
                sender.layer_done(layer)
                if faults.corrupt_kv and layer == 0:
                    if pool.device.type == "cuda":
                        torch.cuda.synchronize(pool.device)  # the layer's copy to the host is done
                    pool.layers[0][0, slots[0]].view(torch.int16).view(-1)[0] ^= 1

            def finish(self) -> None:
                sender.finish()

            def release(self) -> None:
                sender.release()

        return Faulty()
