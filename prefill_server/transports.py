"""The prefill server's side of each pairing: the agreed KV transport per decode peer, NCCL
groups, the exported pool for cuda-ipc, and each job's sender. (A finished job's blocks are held
for its decode side by prefill_server.kv_lease, whatever the transport.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from pd.v1 import prefill_pb2

from engine.runner import ModelRunner
from engine.transport.base import KVSender, KVTransport
from prefill_server.worker import PrefillJob

if TYPE_CHECKING:
    from engine.transport.nccl import NcclPair
    from engine.transport.nccl_rendezvous import PairingHost


SenderFactory = Callable[[PrefillJob, torch.Tensor], KVSender]


class TransportHub:
    def __init__(self, runner: ModelRunner, transfer_timeout_s: float = 60.0) -> None:
        self.runner = runner
        self.timeout_s = transfer_timeout_s
        self._nccl: PairingHost | None = None
        self._ipc_export: tuple[bytes, int] | None = None

    # --- handshake ----------------------------------------------------------------------------
    def pair(self, peer_id: str, transport: KVTransport) -> dict[str, Any]:
        """Set up `transport` for a decode peer; returns the HandshakeResponse fields it needs."""
        if transport == KVTransport.NCCL:
            return self._pair_nccl(peer_id)
        if transport == KVTransport.CUDA_IPC:
            from engine.transport.cuda_ipc import export_pool

            if self._ipc_export is None:
                self._ipc_export = export_pool(self.runner.pool)
            handle, offset = self._ipc_export
            return {"ipc_pool_handle": handle, "ipc_pool_offset": offset,
                    "ipc_pool_num_slots": self.runner.pool.num_slots}
        return {}

    def _pair_nccl(self, peer_id: str) -> dict[str, Any]:
        from engine.transport.nccl_rendezvous import PairingHost

        if self._nccl is None:
            self._nccl = PairingHost(self.runner.device, self.timeout_s)
        pairing = self._nccl.open(peer_id)
        return {"nccl_group": pairing.name, "nccl_secret": pairing.secret}

    def rendezvous(self, request: prefill_pb2.RendezvousRequest) -> prefill_pb2.RendezvousResponse:
        """A store operation of a peer's NCCL pairing (engine.transport.nccl_rendezvous); PermissionError
        unless it carries that pairing's secret."""
        if self._nccl is None:
            raise PermissionError(f"no NCCL pairing of peer {request.peer_id!r}; handshake first")
        return self._nccl.rendezvous(request)

    # --- per request --------------------------------------------------------------------------
    def configure(self, job: PrefillJob) -> None:
        """Give the job the sender (and block ownership) its transport needs; the worker's own
        gRPC sender otherwise."""
        if job.transport == KVTransport.NCCL:
            pair = self._nccl.pair(job.peer_id) if self._nccl is not None else None
            if pair is None or pair.broken:
                raise LookupError("the NCCL pair with this decode server is gone; handshake again")
            job.make_sender = self._nccl_sender(pair)
        elif job.transport == KVTransport.CUDA_IPC:
            job.make_sender = self._ipc_sender

    def _nccl_sender(self, pair: NcclPair) -> SenderFactory:
        from engine.transport.nccl import NcclKVSender

        def make(job: PrefillJob, slots: torch.Tensor) -> KVSender:
            pool = self.runner.pool
            sender = NcclKVSender(pair, pool, slots, self.timeout_s, job.send_start(pool))
            job.emit(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(sequence=sender.sequence)))
            return sender

        return make

    def _ipc_sender(self, job: PrefillJob, slots: torch.Tensor) -> KVSender:
        from engine.transport.cuda_ipc import IpcKVSender

        job.emit(prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(
            src_block_table=job.block_table, src_block_size=self.runner.layout.block_size)))
        return IpcKVSender(lambda layer: job.emit(prefill_pb2.PrefillResponse(layer_sent=layer)))
