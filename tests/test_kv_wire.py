"""The hand-written KV chunk encoding is plain protobuf, both ways."""

from __future__ import annotations

import os

import pytest
from pd.v1 import prefill_pb2

from engine.transport.grpc_wire import KVView, decode_response, encode_kv


@pytest.mark.parametrize(("layer", "start", "end", "size"), [(0, 0, 1, 0), (3, 0, 7, 100), (27, 300, 70000, 1 << 20)])
def test_encoding_round_trips_through_protobuf(layer: int, start: int, end: int, size: int) -> None:
    k, v = os.urandom(size), os.urandom(size // 2)
    wire = encode_kv(layer, start, end, [memoryview(k), v])
    parsed = prefill_pb2.PrefillResponse.FromString(wire)
    assert parsed.WhichOneof("payload") == "kv"
    assert (parsed.kv.layer, parsed.kv.token_start, parsed.kv.token_end, parsed.kv.data) == (layer, start, end, k + v)
    view = decode_response(parsed.SerializeToString())  # a standard peer's encoding decodes too
    assert isinstance(view, KVView)
    assert (view.layer, view.token_start, view.token_end, bytes(view.data)) == (layer, start, end, k + v)


def test_other_messages_go_through_protobuf() -> None:
    done = prefill_pb2.PrefillResponse(done=prefill_pb2.PrefillDone(first_token_id=7, kv_bytes=10))
    assert decode_response(done.SerializeToString()) == done
    start = prefill_pb2.PrefillResponse(start=prefill_pb2.TransferStart(sequence=3, src_block_table=[1, 2]))
    assert decode_response(start.SerializeToString()) == start
