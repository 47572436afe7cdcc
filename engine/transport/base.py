"""The KV data plane between a prefill server and a decode server.

Prefill side: a `KVSender` is told after each layer's prefill kernels are enqueued
(`layer_done`) and ships that layer's KV for the whole prompt while later layers compute;
`finish` returns once everything is on its way. Decode side: a `KVReceiver` puts what arrives
into the decode server's pool at the request's slots. Both sides index the pool through
`KVPool.read`/`write`, so the wire order is the layout's `SHAPE_ORDER`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class TransferCancelled(Exception):
    """The request was cancelled (client gone, deadline, peer failure) mid-transfer."""


class KVSender(ABC):
    # Whether a cancelled request may stop mid-transfer. NCCL may not: the peer has posted its
    # receives, and the pair's sends and receives must stay matched.
    cancellable: bool = True

    @abstractmethod
    def layer_done(self, layer: int) -> None:
        """Called on the engine thread once layer `layer`'s KV writes are enqueued on the device."""

    @abstractmethod
    def finish(self) -> None:
        """Block until every layer has been handed to the transport."""
