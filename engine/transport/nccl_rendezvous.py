"""The NCCL pair's rendezvous, carried by the authenticated gRPC channel instead of a store port.

A TCPStore would listen on every interface and answer anyone: `list_keys` hands out the pairing's
keys, among them NCCL's unique id, and with it a seat in the pair's communicator (and the KV sent
over it). So no store port is opened. The prefill side keeps one in-process store per pairing; the
decode side's half of the pairing uses a `RelayStore`, whose every operation is a `Rendezvous` call
on the channel the handshake used (mutual TLS where configured), carrying the pairing's secret from
the handshake's reply. On the prefill side, `PairingHost` keeps each peer's pairing and runs those
calls (`apply`) for the holder of its secret only.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from pd.v1 import prefill_pb2

from engine.transport.nccl import PREFILL_RANK, NcclPair

log = logging.getLogger(__name__)

Op = prefill_pb2.RendezvousRequest
# A key a get or wait asks for appears once the other rank reaches that step; longer than this is a
# stuck pairing, whatever the caller asked for.
MAX_WAIT_S = 300.0
RPC_SLACK_S = 5.0  # the call's own deadline, beyond the wait it asks the prefill side for

RendezvousCall = Callable[..., prefill_pb2.RendezvousResponse]  # a stub's Rendezvous(request, timeout=...)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: timedelta | None, default: float) -> float:
    return default if timeout is None else timeout.total_seconds()


class RelayStore(dist.Store):
    """Decode side: a torch.distributed store whose operations run on the prefill server's store for
    this pairing, one Rendezvous call each. Whoever builds a process group on it must keep a reference
    to it: torch finds these methods through the Python object."""

    def __init__(self, call: RendezvousCall, peer_id: str, secret: bytes, timeout_s: float) -> None:
        super().__init__()
        self._call, self._peer_id, self._secret = call, peer_id, secret
        self._timeout_s = min(timeout_s, MAX_WAIT_S)

    def _run(self, op: int, keys: list[str], wait_s: float | None = None,
             **fields: object) -> prefill_pb2.RendezvousResponse:
        wait_s = self._timeout_s if wait_s is None else min(wait_s, MAX_WAIT_S)
        request = prefill_pb2.RendezvousRequest(peer_id=self._peer_id, secret=self._secret, op=op,  # type: ignore[arg-type]
                                                keys=keys, timeout_s=wait_s, **fields)  # type: ignore[arg-type]
        return self._call(request, timeout=wait_s + RPC_SLACK_S)

    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        self._run(Op.OP_SET, [key], value=_bytes(value))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._run(Op.OP_GET, [key]).value

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._run(Op.OP_ADD, [key], amount=amount).number

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._run(Op.OP_CHECK, keys, wait_s=0.0).ok

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._run(Op.OP_WAIT, keys, wait_s=_seconds(timeout, self._timeout_s))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:  # type: ignore[override]
        return self._run(Op.OP_COMPARE_SET, [key], expected=_bytes(expected), value=_bytes(desired)).value

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._run(Op.OP_DELETE_KEY, [key], wait_s=0.0).ok

    def num_keys(self) -> int:  # type: ignore[override]
        return self._run(Op.OP_NUM_KEYS, [], wait_s=0.0).number

    def clone(self) -> RelayStore:  # type: ignore[override]
        return self  # stateless but for its channel, which is thread-safe


def apply(store: dist.Store, request: prefill_pb2.RendezvousRequest) -> prefill_pb2.RendezvousResponse:
    """Prefill side: run one relayed operation on the pairing's store. A get or wait that runs out of
    time raises torch's DistStoreError; an unknown operation, ValueError."""
    keys = list(request.keys)
    wait = timedelta(seconds=max(0.0, min(request.timeout_s, MAX_WAIT_S)))
    if request.op in (Op.OP_SET, Op.OP_GET, Op.OP_ADD, Op.OP_COMPARE_SET, Op.OP_DELETE_KEY) and len(keys) != 1:
        raise ValueError(f"{Op.Op.Name(request.op)} takes one key, got {len(keys)}")
    match request.op:
        case Op.OP_SET:
            store.set(keys[0], request.value)
        case Op.OP_GET:
            store.wait(keys, wait)
            return prefill_pb2.RendezvousResponse(value=store.get(keys[0]))
        case Op.OP_ADD:
            return prefill_pb2.RendezvousResponse(number=store.add(keys[0], request.amount))
        case Op.OP_CHECK:
            return prefill_pb2.RendezvousResponse(ok=store.check(keys))
        case Op.OP_WAIT:
            store.wait(keys, wait)
        case Op.OP_COMPARE_SET:
            return prefill_pb2.RendezvousResponse(value=store.compare_set(keys[0], request.expected, request.value))
        case Op.OP_DELETE_KEY:
            return prefill_pb2.RendezvousResponse(ok=store.delete_key(keys[0]))
        case Op.OP_NUM_KEYS:
            return prefill_pb2.RendezvousResponse(number=store.num_keys())
        case _:
            raise ValueError(f"unknown rendezvous operation {request.op}")
    return prefill_pb2.RendezvousResponse()


@dataclass
class HostedPairing:
    """Prefill side: one decode peer's pairing, the secret its Rendezvous calls carry, the store they
    reach, and this side's half of the pair once made."""

    name: str
    secret: bytes
    store: dist.Store
    pair: NcclPair | None = None


class PairingHost:
    """Prefill side: each decode peer's current NCCL pairing (a new handshake replaces it)."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device, self.timeout_s = device, timeout_s
        self._pairings: dict[str, HostedPairing] = {}  # peer_id -> its current pairing
        self._count = 0

    def open(self, peer_id: str) -> HostedPairing:
        """A new pairing for the peer (the old one's pair aborted); this side's half of the pair is made in
        the background, as a Gloo group (on CPU) waits for the other rank while it is made."""
        old = self._pairings.pop(peer_id, None)
        if old is not None and old.pair is not None:
            old.pair.abort()
        self._count += 1
        pairing = HostedPairing(f"{peer_id}/{self._count}", secrets.token_bytes(32), dist.HashStore())
        self._pairings[peer_id] = pairing
        threading.Thread(target=self._make_pair, args=(peer_id, pairing), daemon=True, name="nccl-pair").start()
        return pairing

    def _make_pair(self, peer_id: str, pairing: HostedPairing) -> None:
        try:
            pairing.pair = NcclPair(pairing.store, pairing.name, PREFILL_RANK, self.device, self.timeout_s)
            if self._pairings.get(peer_id) is not pairing:  # the peer handshook again meanwhile
                raise RuntimeError("replaced by a newer pairing")
            pairing.pair.warm_up()
            log.info("NCCL pair %s ready", pairing.name)
        except Exception as e:
            log.warning("NCCL pair %s failed to connect: %s", pairing.name, e)
            if pairing.pair is not None:
                pairing.pair.abort()

    def pair(self, peer_id: str) -> NcclPair | None:
        """The peer's NcclPair, None before this side's half of it is made."""
        pairing = self._pairings.get(peer_id)
        return pairing.pair if pairing is not None else None

    def rendezvous(self, request: prefill_pb2.RendezvousRequest) -> prefill_pb2.RendezvousResponse:
        """One store operation of a peer's half of its current pairing; PermissionError unless the
        request carries that pairing's secret."""
        pairing = self._pairings.get(request.peer_id)
        if pairing is None or not hmac.compare_digest(pairing.secret, request.secret):
            raise PermissionError(f"no NCCL pairing of peer {request.peer_id!r} with this secret; handshake first")
        return apply(pairing.store, request)
