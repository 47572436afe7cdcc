"""The NCCL pair's rendezvous, carried by the authenticated gRPC channel instead of a store port.

A TCPStore would listen on every interface and answer anyone: `list_keys` hands out the pairing's
keys, among them NCCL's unique id, and with it a seat in the pair's communicator (and the KV sent
over it). So no store port is opened. The prefill side keeps one in-process store per pairing; the
decode side's half of the pairing uses a `RelayStore`, whose every operation is a `Rendezvous` call
on the channel the handshake used (mutual TLS where configured), carrying the pairing's secret from
the handshake's reply. `apply` runs such a call on the prefill side.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
from pd.v1 import prefill_pb2

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
