"""The decode server's side of the pair: handshake with prefill servers, run remote prefills, and
put the KV that comes back into this server's pool."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from pd.v1 import decode_pb2, prefill_pb2, prefill_pb2_grpc

from engine.grpc_common import GRPC_OPTIONS
from engine.runner import ModelRunner
from engine.transport.grpc_stream import ChunkError, GrpcKVReceiver
from engine.transport.handshake import (
    choose_transport,
    layout_from_proto,
    layout_mismatch_message,
    layout_to_proto,
    supported_transports,
)

log = logging.getLogger(__name__)


class PrefillFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RemotePrefill:
    first_token: int
    prefill_s: float
    kv_transfer_s: float
    kv_bytes: int
    transport: str


class PrefillPeer:
    """One prefill server: a channel, and the handshake's outcome (redone after a failure)."""

    def __init__(self, address: str, runner: ModelRunner, requested_transport: str,
                 credentials: grpc.ChannelCredentials | None) -> None:
        self.address = address
        self.runner = runner
        self.requested_transport = requested_transport
        self.channel = (grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS) if credentials
                        else grpc.aio.insecure_channel(address, options=GRPC_OPTIONS))
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.transport: str | None = None
        self.in_flight = 0
        self.peer_id = uuid.uuid4().hex[:12]
        self._handshake_lock = asyncio.Lock()

    async def ensure_paired(self, timeout: float) -> str:
        async with self._handshake_lock:
            if self.transport is not None:
                return self.transport
            ours = supported_transports(self.runner.device)
            offer = ours if self.requested_transport == "auto" else [self.requested_transport]
            gpu = self.runner.device.index if self.runner.device.type == "cuda" else -1
            request = prefill_pb2.HandshakeRequest(layout=layout_to_proto(self.runner.layout), transports=offer,
                                                   peer_id=self.peer_id, host=socket.gethostname(),
                                                   gpu_index=gpu if gpu is not None else 0, pid=os.getpid())
            try:
                reply = await self.stub.Handshake(request, timeout=timeout, wait_for_ready=False)
            except grpc.aio.AioRpcError as e:
                raise _peer_error(self.address, e, "handshake") from e
            problem = layout_mismatch_message(self.runner.layout, layout_from_proto(reply.layout))
            if problem:
                raise PrefillFailed(grpc.StatusCode.FAILED_PRECONDITION, f"prefill server {self.address}: {problem}")
            chosen = choose_transport(self.requested_transport, ours, [reply.transport])
            if chosen is None:
                raise PrefillFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill server {self.address} chose KV transport {reply.transport!r}, "
                                    f"which this decode server does not run")
            self.transport = chosen
            log.info("paired with prefill server %s (%s) over %s", self.address, reply.server_id, chosen)
            return chosen

    def forget_pairing(self) -> None:
        self.transport = None


def _peer_error(address: str, e: grpc.aio.AioRpcError, what: str) -> PrefillFailed:
    code = e.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION):
        return PrefillFailed(code, f"prefill server {address}: {e.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PrefillFailed(grpc.StatusCode.UNAVAILABLE,
                             f"prefill server {address} did not finish the {what} in time")
    return PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"prefill server {address} failed during the {what} "
                                                      f"({code.name}: {e.details()})")


class PrefillRouter:
    """Spreads remote prefills over the configured prefill servers (fewest in flight first)."""

    def __init__(self, addresses: list[str], runner: ModelRunner, transport: str, timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        if not addresses:
            raise ValueError("no prefill server address given")
        self.runner = runner
        self.timeout_s = timeout_s
        self.peers = [PrefillPeer(a, runner, transport, credentials) for a in addresses]
        self._rr = itertools.count()
        # One writer thread: KV writes never run on the event loop, and a barrier on this executor
        # proves every write of a request has landed before its blocks can be freed.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-writer")

    def pick(self) -> PrefillPeer:
        start = next(self._rr)
        order = self.peers[start % len(self.peers):] + self.peers[:start % len(self.peers)]
        return min(order, key=lambda p: p.in_flight)

    async def prefill(self, request_id: str, prompt: list[int], sampling: decode_pb2.SamplingParams,
                      block_table: list[int]) -> RemotePrefill:
        peer = self.pick()
        peer.in_flight += 1
        loop = asyncio.get_running_loop()
        receiver = GrpcKVReceiver(self.runner.pool, block_table, len(prompt))
        started = time.perf_counter()
        call = None
        try:
            transport = await peer.ensure_paired(self.timeout_s)
            request = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling,
                                                 transport=transport, peer_id=peer.peer_id)
            call = peer.stub.Prefill(request, timeout=self.timeout_s)
            done = None
            async for message in call:
                kind = message.WhichOneof("payload")
                if kind == "kv":
                    c = message.kv
                    await loop.run_in_executor(self.writer, receiver.write, c.layer, c.token_start, c.token_end,
                                               c.data)
                elif kind == "done":
                    done = message.done
            if done is None or not receiver.complete():
                raise PrefillFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"prefill server {peer.address} ended the stream before all KV arrived")
            await loop.run_in_executor(self.writer, self._sync_device)
            total = time.perf_counter() - started
            return RemotePrefill(done.first_token_id, done.prefill_s, max(0.0, total - done.prefill_s),
                                 receiver.bytes_received, transport)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
                peer.forget_pairing()
            raise _peer_error(peer.address, e, "prefill") from e
        except ChunkError as e:
            raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"prefill server {peer.address} sent bad KV: {e}") from e
        finally:
            peer.in_flight -= 1
            if call is not None and not call.done():
                call.cancel()
            # barrier: no write for this request may land after its blocks are freed
            await asyncio.shield(loop.run_in_executor(self.writer, lambda: None))

    def _sync_device(self) -> None:
        if self.runner.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.runner.device).synchronize()

    async def close(self) -> None:
        for peer in self.peers:
            await peer.channel.close()
        self.writer.shutdown(wait=True)
