"""KV over NIXL (UCX, host memory on the CPU) between two real server processes: the tokens are
those of a colocated prefill, the checksums agree, and a cancel, a prefill server killed
mid-transfer, and its restart leave no block held on either side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.transport.nixl import nixl_available
from launcher.process import start_all, stop_all
from tests.servers import ROOT
from tests.test_reliability import call
from tests.test_reliability_fixtures import Server, request, wait_kv_idle, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]
pytest_plugins = ["tests.test_reliability_fixtures"]

DISAGG, COLOC = decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED
NIXL = ["--kv-transport", "nixl"]
LAYER_DELAY_S = 0.15  # the slow pair's prefill: a transfer takes the tiny model's layers times this


def pair(logs: Path, prefill_env: dict[str, str] | None = None) -> tuple[Server, Server]:
    prefill = Server("prefill_server", NIXL, logs, env=prefill_env)
    decode = Server("decode_server", [*NIXL, "--prefill-addr", prefill.address, "--kv-checksum", "on"], logs)
    start_all([prefill, decode])
    return decode, prefill


@pytest.fixture(scope="module")
def nixl_pair(server_logs: Path) -> Iterator[tuple[Server, Server]]:
    decode, prefill = pair(server_logs)
    yield decode, prefill
    stop_all([decode, prefill])


@pytest.fixture
def slow_pair(server_logs: Path) -> Iterator[tuple[Server, Server]]:
    """A pair whose prefill server takes LAYER_DELAY_S a layer, so a transfer is caught half done."""
    decode, prefill = pair(server_logs, {"PD_FAULT_PREFILL_LAYER_DELAY_S": str(LAYER_DELAY_S)})
    yield decode, prefill
    stop_all([decode, prefill])


def tokens(address: str, req: decode_pb2.GenerateRequest) -> list[int]:
    replies, code, details = call(address, req)
    assert code == grpc.StatusCode.OK, details
    return [r.token_id for r in replies]


def test_tokens_are_colocated_ones_and_kv_is_freed(nixl_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = nixl_pair
    for n, salt in ((5, 0), (33, 1), (300, 2), (1000, 3)):
        remote = tokens(decode.address, request(n, 12, salt, prefill_mode=DISAGG))
        local = tokens(decode.address, request(n, 12, salt, prefill_mode=COLOC))
        assert remote == local, (n, remote, local)
    # a second turn: the decode side's prefix cache holds the first blocks, only the rest comes over
    assert tokens(decode.address, request(1000, 12, 3, prefill_mode=DISAGG)) == local
    m = decode.metrics()
    assert m.get('kv_transfer_bytes_total{transport="nixl"}', 0) > 0, m
    wait_kv_idle(decode, prefill, timeout=5)


def test_prefill_without_destination_is_invalid_argument(nixl_pair) -> None:  # type: ignore[no-untyped-def]
    """A Prefill over nixl must name the decode server's blocks, in the handshake's block size and within its
    pool, from a whole block on, and the notification's tag."""
    decode, prefill = nixl_pair
    tokens(decode.address, request(20, 2, 7, prefill_mode=DISAGG))  # the decode server has paired
    peer = re.findall(r"paired with decode server (\w+) over nixl", prefill.log())[-1]
    base = prefill_pb2.PrefillRequest(request_id="no-destination", token_ids=list(range(40)), transport="nixl",
                                      peer_id=peer)
    short = prefill_pb2.PrefillRequest(dst_tag="t", dst_block_table=[1], dst_block_size=16)
    # the prepared lists name the decode pool in chunks of both block sizes (16 here): the request must agree
    other_size = prefill_pb2.PrefillRequest(dst_tag="t", dst_block_table=[1, 2, 3, 4, 5], dst_block_size=8)
    part_block = prefill_pb2.PrefillRequest(dst_tag="t", dst_block_table=[1, 2, 3], dst_block_size=16,
                                            decode_cached_tokens=5)
    past_pool = prefill_pb2.PrefillRequest(dst_tag="t", dst_block_table=[1, 2, 10**7], dst_block_size=16)
    negative = prefill_pb2.PrefillRequest(dst_tag="t", dst_block_table=[1, -2, 3], dst_block_size=16)
    refusals = ((prefill_pb2.PrefillRequest(), "dst_tag"), (short, "cannot hold the 40-token"),
                (other_size, "dst_block_size is 8"), (part_block, "decode_cached_tokens is 5"),
                (past_pool, "outside the decode server's pool"), (negative, "outside the decode server's pool"))
    with grpc.insecure_channel(prefill.address) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)
        for fields, says in refusals:
            req = prefill_pb2.PrefillRequest()
            req.CopyFrom(base)
            req.MergeFrom(fields)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Prefill(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert says in (e.value.details() or ""), e.value.details()
    wait_kv_idle(decode, prefill, timeout=5)


def test_concurrent_requests_land_in_their_own_blocks(nixl_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = nixl_pair
    expected = {salt: tokens(decode.address, request(200, 8, salt, prefill_mode=COLOC)) for salt in range(6)}
    got: dict[int, list[int]] = {}

    def one(salt: int) -> None:
        got[salt] = tokens(decode.address, request(200, 8, salt, prefill_mode=DISAGG))

    threads = [threading.Thread(target=one, args=(salt,)) for salt in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected
    wait_kv_idle(decode, prefill, timeout=5)


def test_cancel_mid_transfer_frees_both_pools(slow_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = slow_pair
    with grpc.insecure_channel(decode.address) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(request(300, 8, prefill_mode=DISAGG), timeout=60)
        wait_until(lambda: prefill.metrics()["num_requests_running"] == 1, 10)
        time.sleep(LAYER_DELAY_S * 1.5)  # a layer or two written, the rest not
        stream.cancel()
    wait_kv_idle(decode, prefill, timeout=5)
    assert tokens(decode.address, request(40, 4, prefill_mode=DISAGG))  # the pairing still serves
    wait_kv_idle(decode, prefill, timeout=5)


def test_cancel_while_queued_frees_both_pools(slow_pair) -> None:  # type: ignore[no-untyped-def]
    """A prefill cancelled before it started still ends its transfer's notifications ("end"), so the decode
    side frees its blocks at once, not after the wait for a silent peer (the transfer timeout)."""
    decode, prefill = slow_pair
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        running = stub.Generate(request(300, 8, prefill_mode=DISAGG), timeout=60)
        wait_until(lambda: prefill.metrics()["num_requests_running"] == 1, 10)
        queued = stub.Generate(request(200, 8, salt=5, prefill_mode=DISAGG), timeout=60)
        wait_until(lambda: prefill.metrics()["num_requests_waiting"] == 1, 10)
        queued.cancel()
        assert [r.token_id for r in running]  # the one running is served
    wait_kv_idle(decode, prefill, timeout=5)


def test_prefill_killed_mid_transfer_then_restarted(slow_pair) -> None:  # type: ignore[no-untyped-def]
    """The request ends UNAVAILABLE in seconds, no block stays held; the restarted prefill server gets a
    fresh pairing and serves the next request with the same tokens as a colocated prefill."""
    decode, prefill = slow_pair
    outcome: list[tuple[grpc.StatusCode, str, float]] = []

    def generate() -> None:
        started = time.monotonic()
        _, code, details = call(decode.address, request(300, 8, salt=7, prefill_mode=DISAGG), timeout=60)
        outcome.append((code, details, time.monotonic() - started))

    caller = threading.Thread(target=generate)
    caller.start()
    wait_until(lambda: prefill.metrics()["num_requests_running"] == 1, 10)
    time.sleep(LAYER_DELAY_S * 1.5)
    prefill.kill()
    caller.join(30)
    (code, details, took), = outcome
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert took < 15
    wait_kv_idle(decode, timeout=5)

    again = prefill.restarted()
    again.env = {}  # no delay this time
    try:
        again.start()
        expected = tokens(decode.address, request(300, 8, salt=7, prefill_mode=COLOC))
        assert tokens(decode.address, request(300, 8, salt=7, prefill_mode=DISAGG)) == expected
        wait_kv_idle(decode, again, timeout=5)
    finally:
        stop_all([again])


def test_endpoint_benchmark_moves_every_byte_both_ways(tmp_path: Path) -> None:
    """bench.e2e.kv_transfer's nixl endpoints (two processes, host memory here): WRITE and READ rows, bytes equal.
    Run as the command it is: NIXL is never loaded into the test process (see nixl_available)."""
    out = tmp_path / "kv.json"
    done = subprocess.run([sys.executable, "-m", "bench.e2e.kv_transfer", "--mode", "endpoints", "--transport", "nixl",
                           "--preset", "tiny", "--tokens", "300", "--repeats", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["WRITE", "READ"]
    assert all(r["bitwise_equal"] and r["bytes"] > 0 and r["gbps"] > 0 for r in rows), rows
