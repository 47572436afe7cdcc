"""The decode side of each KV transport: what a handshake sets up with one prefill server
(`Pairing`), and the handoff of one remote prefill's KV into this server's pool (`Handoff`).
Each transport has one of each (the concrete pairings are in decode_server.pairings, nixl's both in
decode_server.nixl_receive); `decode_server.pairings.PAIRINGS` names them, so nothing else asks which
transport it is.

Blocks: the request's blocks were reserved at admission and are freed by the scheduler. A handoff
only writes them, and `PrefillRouter` frees nothing until the handoff says that nothing can still
write them (`settled`, else `abandon`)."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import grpc
import torch
from pd.v1 import prefill_pb2

from engine.kv_cache import KVLayout, KVPool
from engine.kv_checksum import first_mismatch, layer_checksums_on_own_stream
from engine.transport.base import KVReceiver, KVTransport
from engine.transport.grpc_stream import ChunkError, GrpcKVReceiver
from engine.transport.grpc_wire import KVView
from serving.grpc_common import StatusError

if TYPE_CHECKING:
    from engine.transport.cuda_ipc import IpcKVReceiver, RemotePool
    from engine.transport.nccl import NcclKVReceiver, NcclPair

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PeerLink:
    """How a pairing reaches its prefill server while it is set up: the id this server has there, and
    a blocking channel like the handshake's (NCCL's rendezvous store is called from the writer thread)."""

    peer_id: str
    open_channel: Callable[[], grpc.Channel]


class HandoffError(StatusError):
    """The KV did not arrive whole."""


class Handoff(ABC):
    """Feeds the control messages of one Prefill stream to its transport's receiver, on the event
    loop; the receiver's calls run on the writer thread (one for the whole server)."""

    transport: ClassVar[KVTransport]
    cancels_call: ClassVar[bool] = True            # leaving early cancels the Prefill call
    receiver: KVReceiver | None

    def __init__(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                 start: int = 0) -> None:
        """The KV of tokens [start, num_tokens) comes over; `start` (the tokens this server's prefix
        cache holds) is a whole number of blocks, so the receivers see those tokens' own blocks."""
        if start % pool.layout.block_size or not 0 <= start < num_tokens:
            raise ValueError(f"a handoff starts at a block boundary before the prompt's end, not at token {start}")
        self.pool, self.block_table, self.num_tokens, self.writer = pool, block_table, num_tokens, writer
        self.start = start
        self.receiver = None
        self.bytes = 0
        self.start_at = 0.0  # monotonic: the transfer's start message arrived (nccl, cuda-ipc)
        self.post_s = 0.0    # setting up the receive after it (nccl: posting every layer's receive)
        self.post_busy_s = 0.0  # the part of post_s spent in the writer thread's calls (the rest: waiting for them)
        self.marks: list[tuple[str, float]] = []  # (what, monotonic): the handoff's timeline, logged at debug level
        self.peer_silent = False  # the prefill server fell silent (frozen, cut off): it may yet resume

    @property
    def sent_table(self) -> list[int]:
        """The blocks of the tokens that come over (token `start` is the first of the first)."""
        return self.block_table[self.start // self.pool.layout.block_size:]

    @property
    def sent_tokens(self) -> int:
        return self.num_tokens - self.start

    def mark(self, what: str) -> None:
        self.marks.append((what, time.monotonic()))

    def _timed(self, call: Callable[..., T], *args: object) -> T:
        """On the writer thread: `call(*args)`, its time added to post_busy_s."""
        started = time.monotonic()
        try:
            return call(*args)
        finally:
            self.post_busy_s += time.monotonic() - started

    def _misfit(self, what: str) -> HandoffError:
        return HandoffError(grpc.StatusCode.UNAVAILABLE, f"{what} does not fit transport {self.transport}")

    async def on_message(self, message: prefill_pb2.PrefillResponse, deadline: float) -> None:
        kind = message.WhichOneof("payload")
        self.mark(f"{kind}{message.layer_sent if kind == 'layer_sent' else ''}")
        if kind == "kv":  # a standard-encoded chunk (grpc_wire decodes ours as KVView)
            c = message.kv
            await self.on_kv(KVView(c.layer, c.token_start, c.token_end, memoryview(c.data)))
        elif kind == "start":
            self.start_at = time.monotonic()
            await self.on_start(message.start, deadline)
            self.post_s = time.monotonic() - self.start_at
            self.mark("posted")
        elif kind == "layer_sent":
            await self.on_layer_sent(message.layer_sent)

    def request_fields(self, request_id: str) -> prefill_pb2.PrefillRequest:
        """What the Prefill request must carry for this handoff, beyond the common fields."""
        return prefill_pb2.PrefillRequest()

    async def on_kv(self, chunk: KVView) -> None:
        raise self._misfit("a KV chunk")

    async def on_start(self, start: prefill_pb2.TransferStart, deadline: float) -> None:
        raise self._misfit("start message")

    async def on_layer_sent(self, layer: int) -> None:
        raise self._misfit("layer_sent message")

    async def wait_complete(self, deadline: float) -> None:
        """Until every layer is in the pool; then `bytes` is what arrived."""
        receiver = self.receiver
        if receiver is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended before any KV arrived")
        while not receiver.complete():
            if receiver.error is not None:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"KV over {self.transport}: {receiver.error}")
            if time.monotonic() > deadline:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"KV over {self.transport} did not arrive in time")
            await asyncio.sleep(0.0002)
        self.bytes = self.sent_tokens * self.pool.layout.bytes_per_token

    def settled(self) -> bool:
        """Nothing can write the blocks any more (asked once the writer thread has run every call queued so far)."""
        return self.receiver is not None and self.receiver.complete()

    async def abandon(self, failed: bool) -> bool:
        """After a failure or cancel: True once nothing can still write into our blocks (they may be
        freed); False if a transfer may still land (the caller must not reuse them)."""
        return True

    async def settled_late(self) -> bool:
        """After `abandon` said False: True once nothing can write the blocks any more (then they may be
        freed after all), False if that is never known."""
        return False

    def verify(self, expected: list[int]) -> None:
        ours = layer_checksums_on_own_stream(self.pool, self.block_table, self.num_tokens, self.start)
        layer = first_mismatch(ours, expected)
        if layer is not None:
            raise HandoffError(grpc.StatusCode.DATA_LOSS, f"the KV that arrived over {self.transport} differs from "
                                                          f"what the prefill server sent (layer {layer}'s checksum)")


class GrpcHandoff(Handoff):
    """KV chunks in the Prefill stream, written into the pool on the writer thread as they come."""

    transport = KVTransport.GRPC
    receiver: GrpcKVReceiver | None

    def _write_chunk(self, chunk: KVView) -> None:
        """On the writer thread (the receiver's slot upload is device work too). A chunk names its
        tokens' positions in the prompt; the receiver counts from the first token sent."""
        if self.receiver is None:
            self.receiver = GrpcKVReceiver(self.pool, self.sent_table, self.sent_tokens)
        self.receiver.write(chunk.layer, chunk.token_start - self.start, chunk.token_end - self.start, chunk.data)

    async def on_kv(self, chunk: KVView) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self.writer, self._write_chunk, chunk)
        except ChunkError as e:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"bad KV chunk: {e}") from e

    async def wait_complete(self, deadline: float) -> None:
        receiver = self.receiver
        if receiver is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended before any KV arrived")
        if not receiver.complete():
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended before all KV arrived")
        await asyncio.get_running_loop().run_in_executor(self.writer, _sync_device, self.pool)
        self.bytes = receiver.bytes_received

    def settled(self) -> bool:
        return True  # every write is a writer-thread call, and those have all run


class NcclHandoff(Handoff):
    """NCCL: at the start message every layer's receive is posted (one writer call); a thread of
    the receiver's watches them land. A receive into the pool's own blocks that stops early leaves
    them unusable until the aborted pair's kernels are gone."""

    transport = KVTransport.NCCL
    cancels_call = False  # our receives are posted: the prefill side's sends must still match them
    receiver: NcclKVReceiver | None

    def __init__(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                 pair: NcclPair, start: int = 0) -> None:
        super().__init__(pool, block_table, num_tokens, writer, start)
        self.pair = pair

    async def on_start(self, start: prefill_pb2.TransferStart, deadline: float) -> None:
        from engine.transport.nccl import NcclKVReceiver, TransferFailed

        def receive() -> None:  # one writer call, not two: each waits for the GIL under load
            self.receiver = NcclKVReceiver(self.pair, self.pool, self.sent_table, self.sent_tokens)
            self.receiver.post(start.sequence, deadline)

        try:
            await asyncio.get_running_loop().run_in_executor(self.writer, self._timed, receive)
        except TransferFailed as e:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, str(e)) from e

    async def abandon(self, failed: bool) -> bool:
        receiver = self.receiver
        if receiver is None or not receiver.posted:
            return True
        if failed:
            self.pair.abort()  # the watching thread stops at the next layer
        limit = time.monotonic() + (5.0 if failed else 120.0)
        while time.monotonic() < limit:
            if receiver.complete():
                return True
            if receiver.stopped.is_set():  # stopped early
                if receiver.into_pool:  # NCCL was writing our blocks: stop its kernels, wait them out
                    self.pair.abort()
                    if await _device_idle(self.pool, limit - time.monotonic()):
                        return True
                    break
                await _drained(receiver.drain_marker())  # NCCL writes only into its staging buffer
                return True
            await asyncio.sleep(0.001)
        log.error("an NCCL transfer never stopped; %d KV blocks stay reserved", len(self.block_table))
        return False


class IpcHandoff(Handoff):
    """cuda-ipc: this side copies each layer out of the prefill server's mapped pool as that side
    reports it written; the prefill side holds its blocks until told the copies are done."""

    transport = KVTransport.CUDA_IPC
    receiver: IpcKVReceiver | None

    def __init__(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                 remote: RemotePool, start: int = 0) -> None:
        super().__init__(pool, block_table, num_tokens, writer, start)
        self.remote = remote
        self.reported = 0  # layers the prefill side says are readable
        self._copying: asyncio.Future[None] | None = None  # the writer's call copying them

    async def on_start(self, start: prefill_pb2.TransferStart, deadline: float) -> None:
        from engine.transport.cuda_ipc import IpcKVReceiver

        def receive() -> IpcKVReceiver:  # the stream, the event, the block lists: all off the event loop
            receiver = IpcKVReceiver(self.remote, self.pool, self.sent_table, self.sent_tokens)
            receiver.start(list(start.src_block_table), start.src_block_size, self.start)
            return receiver

        self.receiver = await asyncio.get_running_loop().run_in_executor(self.writer, self._timed, receive)

    async def on_layer_sent(self, layer: int) -> None:
        # At most one writer call a handoff, copying every layer reported by the time it runs: the
        # calls of every handoff share one thread, and under load each waits long for its turn
        # (bench/NOTES.md).
        if self.receiver is None:
            raise self._misfit("layer_sent message before the start message")
        self.reported = max(self.reported, layer + 1)
        if self._copying is None or self._copying.done():
            if self._copying is not None:
                self._copying.result()  # a failed copy fails the handoff now
            self._queue_copy()

    def _queue_copy(self) -> None:
        self._copying = asyncio.get_running_loop().run_in_executor(self.writer, self._copy_reported)

    def _copy_reported(self) -> None:
        """On the writer thread: queue the copy of every layer reported and not yet copied."""
        assert self.receiver is not None
        while self.receiver.copied < self.reported:
            self.receiver.copy_layer(self.receiver.copied)
        self.mark(f"copied{self.receiver.copied - 1}")

    async def wait_complete(self, deadline: float) -> None:
        while self.receiver is not None:  # copies of the layers reported last are queued
            if self._copying is not None:
                await self._copying
            if self.receiver.copied >= self.reported:
                break
            self._queue_copy()
        await super().wait_complete(deadline)

    async def abandon(self, failed: bool) -> bool:
        if self.receiver is not None:
            await _drained(self.receiver.drain_marker())
        return True


class Pairing(ABC):
    """What the handshake set up with one prefill server for the transport it chose."""

    transport: ClassVar[KVTransport]

    @classmethod
    def offer(cls, pool: KVPool) -> prefill_pb2.HandshakeRequest:
        """On the writer thread, before the handshake: what the request must carry to offer this transport."""
        return prefill_pb2.HandshakeRequest()

    @classmethod
    @abstractmethod
    def connect(cls, reply: prefill_pb2.HandshakeResponse, layout: KVLayout, device: torch.device,
                timeout: float, link: PeerLink) -> Pairing:
        """On the writer thread, after the prefill server's handshake reply; `link` reaches that server."""

    @property
    def broken(self) -> bool:
        """A failure ended the pairing: handshake again before the next prefill."""
        return False

    @abstractmethod
    def forget(self) -> None:
        """Let go of the pairing (its prefill server failed or restarted)."""

    @abstractmethod
    def handoff(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                start: int = 0) -> Handoff:
        """The handoff of one request's KV, tokens [start, num_tokens), over this pairing."""


async def _drained(marker: torch.cuda.Event | None) -> None:
    """Until every copy queued before a receiver's drain marker is done (None on the CPU: nothing is queued)."""
    while marker is not None and not marker.query():
        await asyncio.sleep(0.0005)


async def _device_idle(pool: KVPool, seconds: float) -> bool:
    """True once every kernel queued on the pool's device so far has finished (an aborted NCCL
    pair's included), within `seconds`."""
    if pool.device.type != "cuda":
        return True
    idle = asyncio.get_running_loop().run_in_executor(None, torch.cuda.synchronize, pool.device)
    try:
        await asyncio.wait_for(asyncio.shield(idle), max(0.0, seconds))
        return True
    except TimeoutError:
        return False


def _sync_device(pool: KVPool) -> None:
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
