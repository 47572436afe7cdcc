"""The KV data plane between a prefill server and a decode server: the transports' names and the
two ends of one request's transfer.

Prefill side: a `KVSender` is told after each layer's prefill kernels are enqueued
(`layer_done`) and ships that layer's KV for the whole prompt while later layers compute;
`finish` returns once everything is on its way. Decode side: a `KVReceiver` puts what arrives
into the decode server's pool at the request's slots. Both sides index the pool through
`KVPool.read`/`write`, so the wire order is the layout's `SHAPE_ORDER`.

Neither end allocates or frees KV blocks; the server that owns the pool does, as each class says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import StrEnum


class KVTransport(StrEnum):
    """How KV crosses from the prefill server to the decode server (the names on the wire and in flags)."""

    GRPC = "grpc"          # in the Prefill stream itself: portable, the fallback
    NCCL = "nccl"          # GPU to GPU over the pair's own NCCL group
    CUDA_IPC = "cuda-ipc"  # the decode GPU copies out of the prefill server's mapped pool (same host)
    NIXL = "nixl"          # the prefill server WRITEs into the decode pool over NIXL/UCX (RDMA, TCP, ...)


class TransferCancelled(Exception):
    """The request was cancelled (client gone, deadline, peer failure) mid-transfer."""


class KVSender(ABC):
    """The prefill side of one request's transfer.

    Blocks: the prefill service allocates the prompt's blocks before the job starts; when the job
    ends, whether `finish` returned or raised, the worker hands them to a lease
    (prefill_server.kv_lease) that frees them once the decode side acknowledges (Release) or the
    lease runs out, for every transport (cuda-ipc's decode side reads them after the job). A sender
    never frees a block."""

    # Whether a cancelled request may stop mid-transfer. NCCL may not: the peer has posted its
    # receives, and the pair's sends and receives must stay matched.
    cancellable: bool = True

    @abstractmethod
    def layer_done(self, layer: int) -> None:
        """Called on the engine thread once layer `layer`'s KV writes are enqueued on the device."""

    @abstractmethod
    def finish(self) -> None:
        """Block until every layer has been handed to the transport."""

    def release(self) -> None:  # noqa: B027 (optional: only nixl's sender holds anything by then)
        """Let go of what the transfer still holds, after `finish` returned or raised and the answer
        has left (bookkeeping kept off the request's path). Called once by the worker, whatever happened."""


class KVReceiver(ABC):
    """The decode side of one request's transfer, into blocks the decode server reserved for the
    request before asking for its prefill.

    Blocks: the decode server frees them, never the receiver, and only once nothing can write them
    any more: after `complete()`, or after a failure or cancel once every write the receiver queued
    has finished (`error` says why a transfer stopped early). When that can't be proven (a peer
    that never stops writing), the blocks stay reserved for good rather than risk reuse."""

    error: BaseException | None = None

    @abstractmethod
    def complete(self) -> bool:
        """Every layer's KV for the request's tokens has been written, or queued to be written, into the pool."""
