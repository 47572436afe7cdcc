"""The prefill server's side of each KV transport: what a handshake sets up for a decode peer
(`pair`), and the sender of one job's KV (`sender`). Each transport has one `TransportSenders`;
`SENDERS` names them, as `PAIRINGS` does on the decode side, so nothing else asks which
transport it is. (A finished job's blocks are held for its decode side by prefill_server.kv_lease,
whatever the transport.)"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from pd.v1 import prefill_pb2

from engine.runner import ModelRunner
from engine.transport.base import KVSender, KVTransport
from engine.transport.grpc_stream import GrpcKVSender
from engine.transport.grpc_wire import encode_kv
from prefill_server.worker import PrefillJob
from serving.grpc_common import StartupError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.transport.nccl_rendezvous import PairingHost
    from engine.transport.nixl import NixlAgent
    from engine.transport.nixl_descriptors import PoolAddress, PreparedPools

TRANSFER_TIMEOUT_S = 60.0  # a transfer's sends (and NCCL's rendezvous) give up after this (nixl's own: the same)


class TransportSenders(ABC):
    """One transport's state on the prefill server, for every decode peer paired over it."""

    transport: ClassVar[KVTransport]

    def __init__(self, runner: ModelRunner, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.runner, self.timeout_s = runner, timeout_s

    def pair(self, peer_id: str, request: prefill_pb2.HandshakeRequest) -> prefill_pb2.HandshakeResponse:
        """Set up the transport for a decode peer (off the event loop); returns the reply's fields it adds."""
        return prefill_pb2.HandshakeResponse()

    def check_paired(self, peer_id: str) -> None:  # noqa: B027 (most transports keep nothing per peer)
        """Raises LookupError when the peer's pairing is gone (it must handshake again)."""

    def check_request(self, request: prefill_pb2.PrefillRequest) -> None:  # noqa: B027 (most need no fields)
        """Raises ValueError when the request lacks what this transport needs from it."""

    def forget(self, peer_id: str) -> None:  # noqa: B027 (most transports keep nothing per peer)
        """The peer's pairing is dropped: let go of what was set up for it."""

    def never_sent(self, job: PrefillJob) -> None:  # noqa: B027 (most transports' peers see the call end)
        """The job was cancelled before its sender was made: tell the peer nothing will come."""

    @abstractmethod
    def sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        """On the engine thread: the sender of the job's KV at `slots` (tokens job.send_from on)."""


class GrpcSenders(TransportSenders):
    """KV chunks in the job's own response stream, each naming its tokens' positions in the prompt."""

    transport = KVTransport.GRPC

    def sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        pool, skip = self.runner.pool, job.send_from

        def send(layer: int, start: int, end: int, parts: list[memoryview]) -> None:
            job.out.send(encode_kv(layer, start + skip, end + skip, parts))

        return GrpcKVSender(pool, slots, job.chunk_tokens, send, job.send_start(pool))


class NcclSenders(TransportSenders):
    """Each decode peer's own two-rank NCCL group, its rendezvous relayed through `Rendezvous` calls."""

    transport = KVTransport.NCCL

    def __init__(self, runner: ModelRunner, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        super().__init__(runner, timeout_s)
        self._host: PairingHost | None = None

    def pair(self, peer_id: str, request: prefill_pb2.HandshakeRequest) -> prefill_pb2.HandshakeResponse:
        from engine.transport.nccl_rendezvous import PairingHost

        if self._host is None:
            self._host = PairingHost(self.runner.device, self.timeout_s)
        pairing = self._host.open(peer_id)
        return prefill_pb2.HandshakeResponse(nccl_group=pairing.name, nccl_secret=pairing.secret)

    def rendezvous(self, request: prefill_pb2.RendezvousRequest) -> prefill_pb2.RendezvousResponse:
        """A store operation of a peer's NCCL pairing (engine.transport.nccl_rendezvous); PermissionError
        unless it carries that pairing's secret."""
        if self._host is None:
            raise PermissionError(f"no NCCL pairing of peer {request.peer_id!r}; handshake first")
        return self._host.rendezvous(request)

    def check_paired(self, peer_id: str) -> None:
        pair = self._host.pair(peer_id) if self._host is not None else None
        if pair is None or pair.broken:
            raise LookupError("the NCCL pair with this decode server is gone; handshake again")

    def sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        from engine.transport.nccl import NcclKVSender

        pair = self._host.pair(job.peer_id) if self._host is not None else None
        if pair is None:
            raise LookupError("the NCCL pair with this decode server is gone; handshake again")
        pool = self.runner.pool
        sender = NcclKVSender(pair, pool, slots, self.timeout_s, job.send_start(pool))
        job.out.send(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(sequence=sender.sequence)))
        return sender


class IpcSenders(TransportSenders):
    """The whole pool exported once; the decode side copies each layer out as it is reported written."""

    transport = KVTransport.CUDA_IPC

    def __init__(self, runner: ModelRunner, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        super().__init__(runner, timeout_s)
        self._export: tuple[bytes, int] | None = None

    def pair(self, peer_id: str, request: prefill_pb2.HandshakeRequest) -> prefill_pb2.HandshakeResponse:
        from engine.transport.cuda_ipc import export_pool

        if self._export is None:
            self._export = export_pool(self.runner.pool)
        handle, offset = self._export
        return prefill_pb2.HandshakeResponse(ipc_pool_handle=handle, ipc_pool_offset=offset,
                                             ipc_pool_num_slots=self.runner.pool.num_slots)

    def sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        from engine.transport.cuda_ipc import IpcKVSender

        job.out.send(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(
            src_block_table=job.block_table, src_block_size=self.runner.layout.block_size)))
        return IpcKVSender(lambda layer: job.out.send(prefill_pb2.PrefillResponse(layer_sent=layer)))


@dataclass
class NixlPeer:
    """A decode peer over nixl: its agent's name in ours, its pool, its block size, and both pools' lists
    prepared for this pairing (released when the pairing is replaced or dropped)."""

    agent: str
    pool: PoolAddress
    block_size: int
    prepared: PreparedPools


class NixlSenders(TransportSenders):
    """The pool registered with this server's NIXL agent at start; each decode peer's agent loaded at its
    handshake (again after a restart of either side), and both pools' descriptor lists prepared then,
    once. A job WRITEs into the blocks its request names, by index into those lists."""

    transport = KVTransport.NIXL

    def __init__(self, runner: ModelRunner, timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        from engine.transport.nixl import NixlAgent

        super().__init__(runner, timeout_s)
        try:
            self.agent: NixlAgent = NixlAgent(runner.pool, "prefill")
        except Exception as e:
            raise StartupError(f"can't start a NIXL agent with the UCX backend: {e} (UCX_TLS: docs/nixl.md)") from e
        self._peers: dict[str, NixlPeer] = {}  # decode peer id -> its pairing

    def pair(self, peer_id: str, request: prefill_pb2.HandshakeRequest) -> prefill_pb2.HandshakeResponse:
        from engine.transport.nixl_descriptors import PoolAddress, chunk_tokens

        if not request.nixl_metadata or not request.nixl_pool_addr:
            raise ValueError("the handshake offers nixl without the decode server's NIXL agent and pool")
        agent = self.agent.add_peer(request.nixl_metadata)  # the same agent again: its copy replaced
        pool = PoolAddress(request.nixl_pool_addr, request.nixl_pool_num_slots, request.nixl_pool_device)
        block = request.layout.block_size
        old = self._peers.get(peer_id)
        if old is not None and (old.agent, old.pool, old.block_size) == (agent, pool, block):
            return prefill_pb2.HandshakeResponse(nixl_metadata=self.agent.metadata)  # its lists still serve
        started = time.perf_counter()
        prepared = self.agent.prepare(agent, pool, chunk_tokens(self.runner.layout.block_size, block))
        log.info("prepared NIXL descriptor lists for %s: %d a side, %d-token chunks, in %.1f ms", peer_id,
                 prepared.descriptors, prepared.chunk, (time.perf_counter() - started) * 1e3)
        self._peers[peer_id] = NixlPeer(agent, pool, block, prepared)
        if old is not None:
            self._let_go(old, unload=old.agent != agent)  # a new agent: the decode server restarted
        return prefill_pb2.HandshakeResponse(nixl_metadata=self.agent.metadata)

    def _let_go(self, peer: NixlPeer, unload: bool) -> None:
        self.agent.release_prepared(peer.prepared)
        if unload:
            self.agent.remove_peer(peer.agent)

    def check_paired(self, peer_id: str) -> None:
        if peer_id not in self._peers:
            raise LookupError("no NIXL pairing with this decode server; handshake again")

    def check_request(self, request: prefill_pb2.PrefillRequest) -> None:
        n, table, size = len(request.token_ids), request.dst_block_table, request.dst_block_size
        if not request.dst_tag:
            raise ValueError("a Prefill over nixl needs dst_tag (the notification's tag) and dst_block_table")
        if size < 1 or len(table) * size < n:
            raise ValueError(f"dst_block_table ({len(table)} blocks of {size} tokens) cannot hold the {n}-token "
                             "prompt; name the decode server's blocks for every token")
        peer = self._peers.get(request.peer_id)
        if peer is None:
            return  # check_paired refuses it
        if size != peer.block_size:
            raise ValueError(f"dst_block_size is {size}, but the handshake gave {peer.block_size}; handshake again")
        if request.decode_cached_tokens % size:
            raise ValueError(f"decode_cached_tokens is {request.decode_cached_tokens}; over nixl it must be whole "
                             f"blocks of {size} tokens")
        named = np.asarray(table, dtype=np.int64)[:-(-n // size)]  # one copy, no Python int per block
        if named.min() < 0 or named.max() * size >= peer.pool.num_slots:
            raise ValueError(f"dst_block_table names a block outside the decode server's pool of "
                             f"{peer.pool.num_slots // size} blocks")

    def forget(self, peer_id: str) -> None:
        if (old := self._peers.pop(peer_id, None)) is not None:
            self._let_go(old, unload=True)

    def never_sent(self, job: PrefillJob) -> None:
        """The decode side frees its blocks on "end" at once, rather than after its wait for a silent peer."""
        from engine.transport.nixl import END

        if (peer := self._peers.get(job.peer_id)) is not None and job.dst_tag:
            try:
                self.agent.notify(peer.agent, END + b":" + job.dst_tag.encode())
            except Exception as e:  # the peer is gone: it frees its blocks on the broken call
                log.warning("no 'end' notification to NIXL peer %s: %s", peer.agent, e)

    def sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        from engine.transport.nixl import NixlKVSender, prepared_writes
        from engine.transport.nixl_descriptors import chunk_pairs

        peer = self._peers[job.peer_id]
        layout, chunk = self.runner.layout, peer.prepared.chunk
        pairs = chunk_pairs(job.block_table, layout.block_size, job.dst_block_table, job.dst_block_size,
                            job.send_from, len(job.token_ids), chunk)
        writes = prepared_writes(self.agent, peer.agent, peer.prepared, pairs)
        return NixlKVSender(self.agent, peer.agent, writes, job.dst_tag, layout.num_layers, self.timeout_s,
                            peer.prepared)


SENDERS: dict[KVTransport, type[TransportSenders]] = {
    s.transport: s for s in (GrpcSenders, NcclSenders, IpcSenders, NixlSenders)}
