"""The decode side of one remote prefill's KV handoff, for every transport: put the KV that the
prefill server sends into this server's pool, and say when it is all there."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from pd.v1 import prefill_pb2

from engine.kv_cache import KVPool
from engine.kv_checksum import first_mismatch, layer_checksums
from engine.transport.grpc_stream import ChunkError, GrpcKVReceiver
from engine.transport.grpc_wire import KVView
from serving.grpc_common import StatusError

log = logging.getLogger(__name__)


class HandoffError(StatusError):
    """The KV did not arrive whole."""


class Handoff:
    """Feeds the control messages of one Prefill stream to the transport's receiver."""

    def __init__(self, transport: str, pool: KVPool, block_table: list[int], num_tokens: int,
                 writer: ThreadPoolExecutor, peer: Any) -> None:
        self.transport, self.pool, self.block_table, self.num_tokens = transport, pool, block_table, num_tokens
        self.writer, self.peer = writer, peer
        self.receiver: Any = None
        self.bytes = 0
        self.start_at = 0.0  # monotonic: the transfer's start message arrived (nccl, cuda-ipc)
        self.post_s = 0.0    # setting up the receive after it (nccl: posting every layer's receive)
        self.post_busy_s = 0.0  # the part of post_s spent in the writer thread's calls (the rest: waiting for them)
        self.marks: list[tuple[str, float]] = []  # (what, monotonic): the handoff's timeline, logged at debug level
        self.reported = 0  # cuda-ipc: layers the prefill side says are readable
        self._copying: asyncio.Future[None] | None = None  # cuda-ipc: the writer's call copying them

    def mark(self, what: str) -> None:
        self.marks.append((what, time.monotonic()))

    def _timed(self, call: Any, *args: Any) -> Any:
        """On the writer thread: `call(*args)`, its time added to post_busy_s."""
        started = time.monotonic()
        try:
            return call(*args)
        finally:
            self.post_busy_s += time.monotonic() - started

    def _write_chunk(self, chunk: KVView) -> None:
        """On the writer thread (the receiver's slot upload is device work too)."""
        if self.receiver is None:
            self.receiver = GrpcKVReceiver(self.pool, self.block_table, self.num_tokens)
        self.receiver.write(chunk.layer, chunk.token_start, chunk.token_end, chunk.data)

    async def on_kv(self, chunk: KVView) -> None:
        if self.transport != "grpc":
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"a KV chunk does not fit transport {self.transport}")
        try:
            await asyncio.get_running_loop().run_in_executor(self.writer, self._write_chunk, chunk)
        except ChunkError as e:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"bad KV chunk: {e}") from e

    async def on_message(self, message: prefill_pb2.PrefillResponse, deadline: float) -> None:
        kind = message.WhichOneof("payload")
        self.mark(f"{kind}{message.layer_sent if kind == 'layer_sent' else ''}")
        if kind == "kv":  # a standard-encoded chunk (grpc_wire decodes ours as KVView)
            c = message.kv
            await self.on_kv(KVView(c.layer, c.token_start, c.token_end, memoryview(c.data)))
        elif kind == "start":
            self.start_at = time.monotonic()
            await self._on_start(message.start, deadline)
            self.post_s = time.monotonic() - self.start_at
            self.mark("posted")
        elif kind == "layer_sent" and self.transport == "cuda-ipc" and self.receiver is not None:
            # At most one writer call a handoff, copying every layer reported by the time it runs: the
            # calls of every handoff share one thread, and under load each waits long for its turn (with
            # a call a layer, 60-140 ms each, bench/NOTES.md).
            self.reported = max(self.reported, message.layer_sent + 1)
            if self._copying is None or self._copying.done():
                if self._copying is not None:
                    self._copying.result()  # a failed copy fails the handoff now
                self._queue_copy()
        elif kind in ("kv", "layer_sent"):
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"{kind} message does not fit transport {self.transport}")

    def _queue_copy(self) -> None:
        self._copying = asyncio.get_running_loop().run_in_executor(self.writer, self._copy_reported)

    def _copy_reported(self) -> None:
        """On the writer thread: queue the copy of every layer reported and not yet copied."""
        while self.receiver.copied < self.reported:
            self.receiver.copy_layer(self.receiver.copied)
        self.mark(f"copied{self.receiver.copied - 1}")

    async def _copy_the_rest(self) -> None:
        """cuda-ipc, once the stream has ended: copies of the layers reported last are queued."""
        while True:
            if self._copying is not None:
                await self._copying
            if self.receiver.copied >= self.reported:
                return
            self._queue_copy()

    async def _on_start(self, start: prefill_pb2.TransferStart, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if self.transport == "nccl":
            from engine.transport.nccl import NcclKVReceiver, TransferFailed

            def receive() -> None:  # one writer call, not two: each waits for the GIL under load
                self.receiver = NcclKVReceiver(self.peer.nccl, self.pool, self.block_table, self.num_tokens)
                self.receiver.post(start.sequence, deadline)

            try:
                await loop.run_in_executor(self.writer, self._timed, receive)
            except TransferFailed as e:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        elif self.transport == "cuda-ipc":
            from engine.transport.cuda_ipc import IpcKVReceiver

            receiver = IpcKVReceiver(self.peer.remote_pool, self.pool, self.block_table, self.num_tokens)
            await loop.run_in_executor(self.writer, self._timed, receiver.start, list(start.src_block_table),
                                       start.src_block_size)
            self.receiver = receiver
        else:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"start message does not fit transport {self.transport}")

    async def wait_complete(self, deadline: float) -> None:
        if self.receiver is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended before any KV arrived")
        if self.transport == "grpc":
            if not self.receiver.complete():
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended before all KV arrived")
            await asyncio.get_running_loop().run_in_executor(self.writer, _sync_device, self.pool)
            self.bytes = self.receiver.bytes_received
            return
        if self.transport == "cuda-ipc":
            await self._copy_the_rest()
        while not self.receiver.complete():
            if self.receiver.error is not None:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"KV over {self.transport}: {self.receiver.error}")
            if time.monotonic() > deadline:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"KV over {self.transport} did not arrive in time")
            await asyncio.sleep(0.0002)
        self.bytes = self.num_tokens * self.pool.layout.bytes_per_token

    async def abandon(self, failed: bool) -> bool:
        """After a failure or cancel: True once nothing can still write into our blocks (they may be
        freed); False if a transfer may still land (the caller must not reuse them)."""
        if self.receiver is None or self.transport == "grpc":
            return True
        if self.transport == "cuda-ipc":
            await _drained(self.receiver.drain_marker())
            return True
        if not self.receiver.posted:
            return True
        if failed:
            self.peer.nccl.abort()  # the watching thread stops at the next layer
        limit = time.monotonic() + (5.0 if failed else 120.0)
        while time.monotonic() < limit:
            if self.receiver.complete():
                return True
            if self.receiver.stopped.is_set():  # stopped early
                if self.receiver.into_pool:  # NCCL was writing our blocks: stop its kernels, wait them out
                    self.peer.nccl.abort()
                    if await _device_idle(self.pool, limit - time.monotonic()):
                        return True
                    break
                await _drained(self.receiver.drain_marker())  # NCCL writes only into its staging buffer
                return True
            await asyncio.sleep(0.001)
        log.error("an NCCL transfer never stopped; %d KV blocks stay reserved", len(self.block_table))
        return False

    def verify(self, expected: list[int]) -> None:
        layer = first_mismatch(layer_checksums(self.pool, self.block_table, self.num_tokens), expected)
        if layer is not None:
            raise HandoffError(grpc.StatusCode.DATA_LOSS, f"the KV that arrived over {self.transport} differs from "
                                                          f"what the prefill server sent (layer {layer}'s checksum)")


async def _drained(marker: Any) -> None:
    """Until every copy queued before a receiver's drain marker is done (None on the CPU: nothing is queued)."""
    while marker is not None and not marker.query():
        await asyncio.sleep(0.0005)


async def _device_idle(pool: KVPool, seconds: float) -> bool:
    """True once every kernel queued on the pool's device so far has finished (an aborted NCCL
    pair's included), within `seconds`."""
    if pool.device.type != "cuda":
        return True
    import torch

    idle = asyncio.get_running_loop().run_in_executor(None, torch.cuda.synchronize, pool.device)
    try:
        await asyncio.wait_for(asyncio.shield(idle), max(0.0, seconds))
        return True
    except TimeoutError:
        return False


def _sync_device(pool: KVPool) -> None:
    if pool.device.type == "cuda":
        import torch

        torch.cuda.current_stream(pool.device).synchronize()
