"""Every KV transport's decode side, by name: the registry the handshake picks a `Pairing` from."""

from __future__ import annotations

from decode_server.kv_receive import GrpcPairing, IpcPairing, NcclPairing, Pairing
from decode_server.nixl_receive import NixlPairing
from engine.transport.base import KVTransport

PAIRINGS: dict[KVTransport, type[Pairing]] = {
    p.transport: p for p in (GrpcPairing, NcclPairing, IpcPairing, NixlPairing)}
