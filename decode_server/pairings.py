"""Every KV transport's decode side, by name: the registry the handshake picks a `Pairing` from, and
the pairings of grpc, nccl and cuda-ipc (nixl's is in decode_server.nixl_receive)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from pd.v1 import prefill_pb2, prefill_pb2_grpc

from decode_server.kv_receive import GrpcHandoff, Handoff, IpcHandoff, NcclHandoff, Pairing, PeerLink
from decode_server.nixl_receive import NixlPairing
from engine.kv_cache import KVLayout, KVPool
from engine.transport.base import KVTransport

if TYPE_CHECKING:
    from engine.transport.cuda_ipc import RemotePool
    from engine.transport.nccl import NcclPair


class GrpcPairing(Pairing):
    transport = KVTransport.GRPC

    @classmethod
    def connect(cls, reply: prefill_pb2.HandshakeResponse, layout: KVLayout, device: torch.device,
                timeout: float, link: PeerLink) -> GrpcPairing:
        return cls()

    def forget(self) -> None:
        pass  # nothing was set up beyond the channel

    def handoff(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                start: int = 0) -> Handoff:
        return GrpcHandoff(pool, block_table, num_tokens, writer, start)


class NcclPairing(Pairing):
    """The pair's own two-rank NCCL group, its rendezvous relayed to the prefill server's store for it
    over the handshake's channel (engine.transport.nccl_rendezvous)."""

    transport = KVTransport.NCCL

    def __init__(self, pair: NcclPair) -> None:
        self.pair = pair

    @classmethod
    def connect(cls, reply: prefill_pb2.HandshakeResponse, layout: KVLayout, device: torch.device,
                timeout: float, link: PeerLink) -> NcclPairing:
        from engine.transport.nccl import DECODE_RANK, NcclPair
        from engine.transport.nccl_rendezvous import RelayStore

        with link.open_channel() as channel:  # closed once the pair has met
            store = RelayStore(prefill_pb2_grpc.PrefillStub(channel).Rendezvous, link.peer_id, reply.nccl_secret,
                               timeout)
            pair = NcclPair(store, reply.nccl_group, DECODE_RANK, device, timeout)
            pair.warm_up()
        return cls(pair)

    @property
    def broken(self) -> bool:
        return self.pair.broken

    def forget(self) -> None:
        self.pair.abort()

    def handoff(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                start: int = 0) -> Handoff:
        return NcclHandoff(pool, block_table, num_tokens, writer, self.pair, start)


class IpcPairing(Pairing):
    """The prefill server's whole KV pool, mapped into this process once."""

    transport = KVTransport.CUDA_IPC

    def __init__(self, remote: RemotePool) -> None:
        self.remote = remote

    @classmethod
    def connect(cls, reply: prefill_pb2.HandshakeResponse, layout: KVLayout, device: torch.device,
                timeout: float, link: PeerLink) -> IpcPairing:
        from engine.transport.cuda_ipc import RemotePool

        return cls(RemotePool(layout, reply.ipc_pool_handle, reply.ipc_pool_offset, reply.ipc_pool_num_slots, device))

    def forget(self) -> None:
        pass  # the mapping stays open: copies queued from it may still run

    def handoff(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                start: int = 0) -> Handoff:
        return IpcHandoff(pool, block_table, num_tokens, writer, self.remote, start)


PAIRINGS: dict[KVTransport, type[Pairing]] = {
    p.transport: p for p in (GrpcPairing, NcclPairing, IpcPairing, NixlPairing)}
