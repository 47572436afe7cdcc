"""The decode side of KV over NIXL (engine.transport.nixl): the pool registered once with this
server's agent, offered at every handshake; the prefill server WRITEs into the request's blocks
and notifies when it is done (or stopped), so the handoff only waits for that notification."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import grpc
import torch
from pd.v1 import prefill_pb2

from decode_server.kv_receive import Handoff, HandoffError, Pairing, PeerLink
from engine.kv_cache import KVLayout, KVPool
from engine.transport.base import KVTransport
from engine.transport.nixl import NixlAgent, NixlKVReceiver, PoolAddress

log = logging.getLogger(__name__)

PEER_GONE_WAIT_S = 2.0  # after a failure, how long a silent prefill server may still be writing

_agent: NixlAgent | None = None  # this server's, with its pool: made at the first offer (start-up)
_agent_lock = threading.Lock()


def agent_for(pool: KVPool) -> NixlAgent:
    global _agent
    with _agent_lock:
        if _agent is None or _agent.pool is not pool:
            _agent = NixlAgent(pool, "decode")
        return _agent


class NixlHandoff(Handoff):
    """The blocks' table goes in the Prefill request; the KV lands without a message of ours."""

    transport = KVTransport.NIXL
    receiver: NixlKVReceiver | None

    def __init__(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                 agent: NixlAgent, peer: str, start: int = 0) -> None:
        super().__init__(pool, block_table, num_tokens, writer, start)
        self.agent, self.peer = agent, peer
        self.receiver = None  # made with the request's fields: the request id tags the transfer

    def request_fields(self, request_id: str) -> prefill_pb2.PrefillRequest:
        self.receiver = NixlKVReceiver(self.agent, self.peer, request_id)
        return prefill_pb2.PrefillRequest(dst_block_table=self.block_table, dst_block_size=self.pool.layout.block_size)

    async def wait_complete(self, deadline: float) -> None:
        receiver = self.receiver
        assert receiver is not None
        while not receiver.complete():
            if receiver.error is not None:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, f"KV over nixl: {receiver.error}")
            if time.monotonic() > deadline:
                raise HandoffError(grpc.StatusCode.UNAVAILABLE, "KV over nixl did not arrive in time")
            await asyncio.sleep(0.0002)
        if self.pool.device.type == "cuda":  # UCX wrote behind the device's back: order it before our use
            torch.cuda.synchronize(self.pool.device)
        self.bytes = self.sent_tokens * self.pool.layout.bytes_per_token

    async def abandon(self, failed: bool) -> bool:
        """Until the prefill side's last notification says nothing more will land; after a failure
        (the call broke: the peer died or cut us off) a silent peer is taken as stopped after a moment."""
        receiver = self.receiver
        if receiver is None:
            return True  # no Prefill request went out
        limit = time.monotonic() + (PEER_GONE_WAIT_S if failed else 120.0)
        while time.monotonic() < limit:
            receiver.complete()
            if receiver.ended:
                return True
            await asyncio.sleep(0.001)
        if failed:
            log.warning("no last notification from NIXL peer %s; it is taken as stopped", receiver.peer)
            return True
        log.error("a NIXL transfer never ended; %d KV blocks stay reserved", len(self.block_table))
        return False


class NixlPairing(Pairing):
    """The prefill server's agent loaded into ours; dropped (and loaded afresh at the next handshake)
    when that server fails or restarts."""

    transport: ClassVar[KVTransport] = KVTransport.NIXL

    def __init__(self, agent: NixlAgent, peer: str) -> None:
        self.agent, self.peer = agent, peer

    @classmethod
    def offer(cls, pool: KVPool) -> prefill_pb2.HandshakeRequest:
        agent = agent_for(pool)
        where = PoolAddress.of(pool)
        return prefill_pb2.HandshakeRequest(nixl_metadata=agent.metadata, nixl_pool_addr=where.addr,
                                            nixl_pool_num_slots=where.num_slots, nixl_pool_device=where.device)

    @classmethod
    def connect(cls, reply: prefill_pb2.HandshakeResponse, layout: KVLayout, device: torch.device,
                timeout: float, link: PeerLink) -> NixlPairing:
        if not reply.nixl_metadata:
            raise ValueError("the handshake reply carries no NIXL agent metadata")
        if _agent is None:
            raise ValueError("no NIXL agent: the handshake did not offer nixl")
        return cls(_agent, _agent.add_peer(reply.nixl_metadata))

    def forget(self) -> None:
        self.agent.remove_peer(self.peer)

    def handoff(self, pool: KVPool, block_table: list[int], num_tokens: int, writer: ThreadPoolExecutor,
                start: int = 0) -> Handoff:
        return NixlHandoff(pool, block_table, num_tokens, writer, self.agent, self.peer, start)
