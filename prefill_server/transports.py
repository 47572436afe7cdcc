"""The prefill server's side of each pairing: the agreed KV transport per decode peer, NCCL
groups, the exported pool for cuda-ipc, and blocks held until a decode side has copied them."""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pd.v1 import prefill_pb2

from engine.runner import ModelRunner
from engine.transport.base import KVSender
from prefill_server.worker import PrefillJob

log = logging.getLogger(__name__)

SenderFactory = Callable[[PrefillJob, torch.Tensor], KVSender]


@dataclass
class NcclPairing:
    """A decode peer's NCCL pairing: the secret its Rendezvous calls carry, the store they reach, and
    the pair once this side's half is made."""

    name: str
    secret: bytes
    store: Any  # torch.distributed.HashStore
    pair: Any = None  # NcclPair


class TransportHub:
    def __init__(self, runner: ModelRunner, transfer_timeout_s: float = 60.0) -> None:
        self.runner = runner
        self.timeout_s = transfer_timeout_s
        self._nccl: dict[str, NcclPairing] = {}   # peer_id -> its current pairing
        self._ipc_export: tuple[bytes, int] | None = None
        self._held: dict[tuple[str, str], tuple[list[int], float]] = {}  # (peer, request) -> blocks, deadline
        self._released_early: set[tuple[str, str]] = set()  # acknowledged before the job let go
        self._lock = threading.Lock()
        self._pairings = 0

    # --- handshake ----------------------------------------------------------------------------
    def pair(self, peer_id: str, transport: str) -> dict[str, Any]:
        """Set up `transport` for a decode peer; returns the HandshakeResponse fields it needs."""
        if transport == "nccl":
            return self._pair_nccl(peer_id)
        if transport == "cuda-ipc":
            from engine.transport.cuda_ipc import export_pool

            if self._ipc_export is None:
                self._ipc_export = export_pool(self.runner.pool)
            handle, offset = self._ipc_export
            return {"ipc_pool_handle": handle, "ipc_pool_offset": offset,
                    "ipc_pool_num_slots": self.runner.pool.num_slots}
        return {}

    def _pair_nccl(self, peer_id: str) -> dict[str, Any]:
        """A new pairing whose store only this peer's Rendezvous calls reach; this side's half of the pair
        is made in the background (a Gloo group, on CPU, waits for the other rank as it is made)."""
        import torch.distributed as dist

        old = self._nccl.pop(peer_id, None)
        if old is not None and old.pair is not None:
            old.pair.abort()
        self._pairings += 1
        pairing = NcclPairing(f"{peer_id}/{self._pairings}", secrets.token_bytes(32), dist.HashStore())
        self._nccl[peer_id] = pairing
        threading.Thread(target=self._make_pair, args=(peer_id, pairing), daemon=True, name="nccl-pair").start()
        return {"nccl_group": pairing.name, "nccl_secret": pairing.secret}

    def _make_pair(self, peer_id: str, pairing: NcclPairing) -> None:
        from engine.transport.nccl import PREFILL_RANK, NcclPair

        try:
            pairing.pair = NcclPair(pairing.store, pairing.name, PREFILL_RANK, self.runner.device, self.timeout_s)
            if self._nccl.get(peer_id) is not pairing:  # the peer handshook again meanwhile
                raise RuntimeError("replaced by a newer pairing")
            pairing.pair.warm_up()
            log.info("NCCL pair %s ready", pairing.name)
        except Exception as e:
            log.warning("NCCL pair %s failed to connect: %s", pairing.name, e)
            if pairing.pair is not None:
                pairing.pair.abort()

    def nccl_pair(self, peer_id: str) -> Any:
        """The peer's NcclPair, None before this side's half of it is made."""
        pairing = self._nccl.get(peer_id)
        return pairing.pair if pairing is not None else None

    def rendezvous(self, request: prefill_pb2.RendezvousRequest) -> prefill_pb2.RendezvousResponse:
        """One store operation of a peer's half of its current pairing (engine.transport.nccl_rendezvous).
        PermissionError unless the request carries that pairing's secret."""
        from engine.transport.nccl_rendezvous import apply

        pairing = self._nccl.get(request.peer_id)
        if pairing is None or not hmac.compare_digest(pairing.secret, request.secret):
            raise PermissionError(f"no NCCL pairing of peer {request.peer_id!r} with this secret; handshake first")
        return apply(pairing.store, request)

    # --- per request --------------------------------------------------------------------------
    def configure(self, job: PrefillJob, peer_id: str, transport: str) -> None:
        """Give the job the sender (and block ownership) its transport needs."""
        if transport == "nccl":
            pair = self.nccl_pair(peer_id)
            if pair is None or pair.broken:
                raise LookupError("the NCCL pair with this decode server is gone; handshake again")
            job.make_sender = self._nccl_sender(pair)
        elif transport == "cuda-ipc":
            job.make_sender = self._ipc_sender
            job.hold_blocks = lambda j: self._hold(peer_id, j)

    def _nccl_sender(self, pair: Any) -> SenderFactory:
        from engine.transport.nccl import NcclKVSender

        def make(job: PrefillJob, slots: torch.Tensor) -> KVSender:
            pool = self.runner.pool
            sender = NcclKVSender(pair, pool, slots, self.timeout_s, pool.table_start(job.block_table, slots.numel()))
            job.emit(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(sequence=sender.sequence)))
            return sender

        return make

    def _ipc_sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        from engine.transport.cuda_ipc import IpcKVSender

        job.emit(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(
            src_block_table=job.block_table, src_block_size=self.runner.layout.block_size)))
        return IpcKVSender(lambda layer: job.emit(prefill_pb2.PrefillResponse(layer_sent=layer)))

    # --- cuda-ipc block ownership --------------------------------------------------------------
    def _hold(self, peer_id: str, job: PrefillJob) -> None:
        key = (peer_id, job.request_id)
        with self._lock:
            early = key in self._released_early
            self._released_early.discard(key)
            if not early:
                self._held[key] = (job.block_table, time.monotonic() + self.timeout_s)
        if early:
            self.runner.pool.allocator.free(job.block_table)
        self.sweep()

    def release(self, peer_id: str, request_id: str) -> None:
        key = (peer_id, request_id)
        with self._lock:
            held = self._held.pop(key, None)
            if held is None:
                self._released_early.add(key)
        if held is not None:
            self.runner.pool.allocator.free(held[0])

    def sweep(self) -> None:
        """Free blocks whose decode side never acknowledged (it died); it can't read them any more
        once it is gone, and a live one has had the whole transfer timeout."""
        now = time.monotonic()
        with self._lock:
            expired = [k for k, (_, deadline) in self._held.items() if deadline < now]
            blocks = [self._held.pop(k)[0] for k in expired]
        for b in blocks:
            self.runner.pool.allocator.free(b)
        if expired:
            log.warning("freed the KV of %d cuda-ipc transfers never acknowledged", len(expired))
