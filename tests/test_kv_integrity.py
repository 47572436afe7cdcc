"""KV checksums by default: a handoff whose KV differs from what the prefill server checksummed (one bit,
flipped by PD_FAULT_PREFILL_CORRUPT_KV after the send) fails the request DATA_LOSS before its first token,
and the pairing is dropped (the next request handshakes again); with --kv-checksum off nothing notices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from tests.test_reliability_fixtures import Server, request, start_all, stop_all, wait_kv_idle

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

PAIRED = "paired with decode server"


@pytest.fixture(scope="module")
def corrupting(server_logs: Path) -> Iterator[tuple[Server, Server, Server]]:
    prefill = Server("prefill_server", [], server_logs, env={"PD_FAULT_PREFILL_CORRUPT_KV": "1"})
    checked = Server("decode_server", ["--prefill-addr", prefill.address], server_logs)
    unchecked = Server("decode_server", ["--prefill-addr", prefill.address, "--kv-checksum", "off"], server_logs)
    start_all([prefill, checked, unchecked])
    yield prefill, checked, unchecked
    stop_all([checked, unchecked, prefill])


def generate(server: Server, replies: list[decode_pb2.GenerateResponse]) -> list[decode_pb2.GenerateResponse]:
    with grpc.insecure_channel(server.address) as ch:
        for reply in decode_pb2_grpc.DecodeStub(ch).Generate(
                request(40, 4, prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=30):
            replies.append(reply)
    return replies


def test_a_corrupted_handoff_fails_data_loss_and_drops_the_pairing(
        corrupting: tuple[Server, Server, Server]) -> None:
    prefill, checked, _ = corrupting
    for attempt in (1, 2):
        replies: list[decode_pb2.GenerateResponse] = []
        with pytest.raises(grpc.RpcError) as e:
            generate(checked, replies)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS, e.value  # type: ignore[attr-defined]
        assert not replies, "no token before the KV is proven"
        assert "layer 0's checksum" in e.value.details()  # type: ignore[attr-defined]
        assert prefill.log().count(PAIRED) >= attempt, "each request after a mismatch pairs anew"
    wait_kv_idle(checked, prefill, timeout=10)  # the blocks of both sides are back


def test_without_checksums_the_same_corruption_goes_unnoticed(corrupting: tuple[Server, Server, Server]) -> None:
    prefill, _, unchecked = corrupting
    replies = generate(unchecked, [])
    assert [r.index for r in replies] == [0, 1, 2, 3]
    wait_kv_idle(unchecked, prefill, timeout=10)
