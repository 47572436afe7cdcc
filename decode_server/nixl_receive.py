"""The decode side of KV over NIXL (engine.transport.nixl): the pool registered once with this
server's agent, offered at every handshake; the prefill server WRITEs into the request's blocks
and notifies when it is done (or stopped), so the handoff only waits for that notification."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import torch
from pd.v1 import prefill_pb2

from decode_server.kv_receive import Handoff, Pairing, PeerLink
from engine.kv_cache import KVLayout, KVPool
from engine.transport.base import KVTransport
from engine.transport.nixl import TRANSFER_TIMEOUT_S, NixlAgent, NixlKVReceiver
from engine.transport.nixl_descriptors import PoolAddress

log = logging.getLogger(__name__)

ENDED_WAIT_S = 2.0  # after a failure or cancel, how long the prefill side's last notification may take

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
        self.receiver = None  # made with the request's fields

    def request_fields(self, request_id: str) -> prefill_pb2.PrefillRequest:
        # a tag of its own: a late notification of an earlier transfer (a request id used again) never counts
        tag = f"{request_id}:{uuid.uuid4().hex[:12]}"
        self.receiver = NixlKVReceiver(self.agent, self.peer, tag)
        return prefill_pb2.PrefillRequest(dst_block_table=self.block_table, dst_block_size=self.pool.layout.block_size,
                                          dst_tag=tag)

    async def abandon(self, failed: bool) -> bool:
        """True once the prefill side's last notification says nothing more will land. Without it in a
        moment: a prefill server whose call broke (its process or connection gone) is taken as stopped;
        one that fell silent (it may resume) or was cancelled keeps the blocks until `settled_late`."""
        if self.receiver is None:
            return True  # no Prefill request went out
        if await self._ended_within(ENDED_WAIT_S):
            return True
        if failed and not self.peer_silent:
            log.warning("no last notification from NIXL peer %s; its transfer is taken as stopped", self.peer)
            return True
        return False

    async def settled_late(self) -> bool:
        """Its last notification, or the prefill side's transfer timeout (its sender has let go of
        every write by then)."""
        if not await self._ended_within(TRANSFER_TIMEOUT_S + ENDED_WAIT_S):
            log.warning("no last notification from NIXL peer %s in %.0fs; its transfer is taken as stopped",
                        self.peer, TRANSFER_TIMEOUT_S + ENDED_WAIT_S)
        return True

    async def _ended_within(self, seconds: float) -> bool:
        receiver = self.receiver
        assert receiver is not None
        limit = time.monotonic() + seconds
        while not receiver.ended and time.monotonic() < limit:
            receiver.complete()
            await asyncio.sleep(0.001)
        return receiver.ended


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
