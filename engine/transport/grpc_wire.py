"""KV chunks on the wire without protobuf's copies.

A KV chunk is almost all payload; building it as a protobuf message, serializing it, parsing it
and reading its bytes field costs four copies of every KV byte. Here the sender writes the
message's wire bytes itself (header + K + V: one copy) and the receiver reads the payload as a
view of the received bytes (no copy). The encoding is plain protobuf (`PrefillResponse.kv`,
field numbers from the generated descriptors), so either side also interoperates with a
standard peer; every other message goes through protobuf as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from pd.v1 import prefill_pb2

_KV_FIELD = prefill_pb2.PrefillResponse.DESCRIPTOR.fields_by_name["kv"].number
_CHUNK = prefill_pb2.KVChunk.DESCRIPTOR.fields_by_name
_LAYER, _START, _END, _DATA = (_CHUNK[n].number for n in ("layer", "token_start", "token_end", "data"))
_VARINT, _LEN = 0, 2
PREFILL_METHOD = "/pd.v1.Prefill/Prefill"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def encode_kv(layer: int, start: int, end: int, parts: Iterable[memoryview | bytes]) -> bytes:
    """The wire bytes of `PrefillResponse(kv=KVChunk(layer, start, end, data=b"".join(parts)))`."""
    parts = list(parts)
    size = sum(memoryview(p).nbytes for p in parts)
    chunk_head = (_varint(_LAYER << 3 | _VARINT) + _varint(layer) + _varint(_START << 3 | _VARINT) + _varint(start)
                  + _varint(_END << 3 | _VARINT) + _varint(end) + _varint(_DATA << 3 | _LEN) + _varint(size))
    head = _varint(_KV_FIELD << 3 | _LEN) + _varint(len(chunk_head) + size) + chunk_head
    return b"".join([head, *parts])


@dataclass(frozen=True)
class KVView:
    """A received KV chunk; `data` is a view into the message's bytes."""

    layer: int
    token_start: int
    token_end: int
    data: memoryview


def _decode_chunk(buf: memoryview) -> KVView:
    fields: dict[int, Any] = {_LAYER: 0, _START: 0, _END: 0, _DATA: memoryview(b"")}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            fields[number], pos = _read_varint(buf, pos)
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            fields[number] = buf[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"unexpected wire type {wire} in a KV chunk")
    return KVView(fields[_LAYER], fields[_START], fields[_END], fields[_DATA])


def decode_response(raw: bytes) -> prefill_pb2.PrefillResponse | KVView:
    buf = memoryview(raw)
    if len(buf) and buf[0] == (_KV_FIELD << 3 | _LEN):
        size, pos = _read_varint(buf, 1)
        if pos + size == len(buf):
            return _decode_chunk(buf[pos:])
    return prefill_pb2.PrefillResponse.FromString(raw)


def kv_payload_bytes(wire: bytes) -> int:
    """KV bytes in an encoded chunk (its size less the message header)."""
    view = decode_response(wire)
    return view.data.nbytes if isinstance(view, KVView) else 0


def serialize_response(message: prefill_pb2.PrefillResponse | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_prefill_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Like the generated `add_PrefillServicer_to_server`, but Prefill may yield pre-encoded bytes."""
    from pd.v1 import prefill_pb2_grpc

    generic = grpc.method_handlers_generic_handler("pd.v1.Prefill", {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake, request_deserializer=prefill_pb2.HandshakeRequest.FromString,
            response_serializer=prefill_pb2.HandshakeResponse.SerializeToString),
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=prefill_pb2.PrefillRequest.FromString,
            response_serializer=serialize_response),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release, request_deserializer=prefill_pb2.ReleaseRequest.FromString,
            response_serializer=prefill_pb2.ReleaseResponse.SerializeToString),
        "Rendezvous": grpc.unary_unary_rpc_method_handler(
            servicer.Rendezvous, request_deserializer=prefill_pb2.RendezvousRequest.FromString,
            response_serializer=prefill_pb2.RendezvousResponse.SerializeToString),
    })
    server.add_generic_rpc_handlers((generic,))
    assert {"Handshake", "Prefill", "Release", "Rendezvous"} == set(
        prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].methods_by_name), prefill_pb2_grpc.__name__


def prefill_stream(channel: grpc.aio.Channel) -> Callable[..., Any]:
    """Prefill as a callable whose messages are PrefillResponse, or KVView for KV chunks."""
    return channel.unary_stream(PREFILL_METHOD, request_serializer=prefill_pb2.PrefillRequest.SerializeToString,
                                response_deserializer=decode_response)
