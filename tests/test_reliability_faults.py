"""Faults between the servers, against real processes: the prefill server SIGKILLed mid-prefill and
mid-transfer, down, and restarted on its port; cancels and deadlines while the prefill server holds
the KV; SIGTERM drains of both servers with streams in flight.

The prefill server here runs with PD_FAULT_PREFILL_LAYER_DELAY_S, so each prefill takes a known
time (4 layers x 0.4 s) and its KV leaves layer by layer: a test can act "before any KV was sent"
(mid-prefill) or "after some layers' KV was sent" (mid-transfer), read from the prefill server's
metrics (`num_requests_running`, `kv_streamed_bytes_total`)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from launcher.process import start_all, stop_all
from tests.test_reliability_fixtures import (
    Server,
    health_status,
    kv_idle,
    request,
    wait_kv_idle,
    wait_until,
)

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures"]

LAYER_DELAY_S = 0.4
DISAGG, COLOC = decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED
LOCAL_MODES = (COLOC, decode_pb2.PREFILL_MODE_CHUNKED, decode_pb2.PREFILL_MODE_LAYERED)
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Pending:
    """A Generate running on its own thread: (status code, details, replies, seconds) once `result()`."""

    def __init__(self, address: str, req: decode_pb2.GenerateRequest, timeout: float = 30.0) -> None:
        self.replies: list[decode_pb2.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.channel = grpc.insecure_channel(address)
        self.started = time.monotonic()
        self.ended = 0.0
        self.stream = decode_pb2_grpc.DecodeStub(self.channel).Generate(req, timeout=timeout)
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            for r in self.stream:
                self.replies.append(r)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details() or ""  # type: ignore[attr-defined]
        self.ended = time.monotonic()

    def result(self, timeout: float = 30.0) -> Pending:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream hung"
        self.channel.close()
        return self

    def cancel(self) -> None:
        self.stream.cancel()


def tokens(address: str, req: decode_pb2.GenerateRequest) -> list[int]:
    p = Pending(address, req).result()
    assert p.code == grpc.StatusCode.OK, (p.code, p.details)
    return [r.token_id for r in p.replies]


@pytest.fixture(scope="module")
def slow_pair(server_logs: Path) -> Iterator[dict[str, Server]]:
    """{'decode', 'prefill'}: the prefill server's layers each take LAYER_DELAY_S; tests may replace it."""
    prefill = Server("prefill_server", [], server_logs, env={"PD_FAULT_PREFILL_LAYER_DELAY_S": str(LAYER_DELAY_S)})
    decode = Server("decode_server", ["--prefill-addr", prefill.address, "--prefill-timeout-s", "30"], server_logs)
    start_all([prefill, decode])
    servers = {"decode": decode, "prefill": prefill}
    yield servers
    stop_all([servers["decode"], servers["prefill"]])


def streamed(prefill: Server) -> float:
    return prefill.metrics()["kv_streamed_bytes_total"]


def test_cancel_and_deadline_while_the_prefill_server_holds_kv(slow_pair: dict[str, Server]) -> None:
    decode, prefill = slow_pair["decode"], slow_pair["prefill"]
    wait_kv_idle(decode, prefill)
    # cancel mid-transfer: layer 0's KV has gone out, layers 1-3 not yet
    before = streamed(prefill)
    p = Pending(decode.address, request(1000, 8))
    wait_until(lambda: streamed(prefill) > before, 5)
    assert prefill.metrics()["num_requests_running"] == 1
    m = decode.metrics()
    assert m["kv_cache_free_blocks"] < m["kv_cache_total_blocks"] and m["num_requests_waiting"] == 1
    p.cancel()
    assert p.result().code == grpc.StatusCode.CANCELLED
    # both pools whole again once the prefill worker reaches its next layer boundary
    assert wait_kv_idle(decode, prefill, timeout=3 * LAYER_DELAY_S + 2) < 3 * LAYER_DELAY_S + 2
    # deadline mid-prefill (before any KV): DEADLINE_EXCEEDED at the deadline, KV freed on both sides
    p = Pending(decode.address, request(1000, 8, request_id="deadline-in-prefill"), timeout=0.25)
    assert p.result().code == grpc.StatusCode.DEADLINE_EXCEEDED and p.replies == []
    assert p.ended - p.started < 1.5
    wait_kv_idle(decode, prefill, timeout=3 * LAYER_DELAY_S + 2)
    assert '"request_id": "deadline-in-prefill", "status": "DEADLINE_EXCEEDED"' in decode.log()
    assert prefill.metrics()['prefill_requests_total{status="CANCELLED"}'] >= 1


def test_prefill_server_killed_mid_prefill_and_mid_transfer(slow_pair: dict[str, Server]) -> None:
    decode, prefill = slow_pair["decode"], slow_pair["prefill"]
    wait_kv_idle(decode, prefill)
    reference = tokens(decode.address, request(1000, 8, prefill_mode=COLOC))
    # A: its KV is streaming (layer 0 sent, 1-3 to come); B: accepted by the prefill server, queued
    # behind A, nothing computed or sent (mid-prefill from the decode server's side).
    before = streamed(prefill)
    a = Pending(decode.address, request(1000, 8))
    wait_until(lambda: streamed(prefill) > before, 5)
    b = Pending(decode.address, request(600, 8, salt=1))
    wait_until(lambda: prefill.metrics()["num_requests_waiting"] == 1, 2)
    assert a.code is None and b.code is None and a.replies == [] and b.replies == []
    killed = time.monotonic()
    prefill.kill()
    for p in (a.result(), b.result()):
        assert p.code == UNAVAILABLE, (p.code, p.details)
        assert prefill.address in p.details and "\n" not in p.details
        assert p.ended - killed < 3  # at once, not at the 30 s deadline
    wait_until(lambda: kv_idle(decode), 3)

    # the prefill server is down: disaggregated requests fail fast, local ones are served
    p = Pending(decode.address, request(50, 4), timeout=10).result()
    assert p.code == UNAVAILABLE and p.ended - p.started < 3, (p.code, p.details)
    for mode in LOCAL_MODES:
        assert tokens(decode.address, request(1000, 8, prefill_mode=mode)) == reference
    assert health_status(decode.address) == "SERVING"

    # restarted on the same port: used again without a restart of the decode server, as soon as its
    # channel's reconnect backoff (at most 1 s, serving.grpc_common) lets it see the new process
    prefill = slow_pair["prefill"] = prefill.restarted().start()
    back = time.monotonic()
    while (p := Pending(decode.address, request(1000, 8)).result()).code == UNAVAILABLE:
        assert time.monotonic() - back < 5, p.details
        time.sleep(0.1)
    assert p.code == grpc.StatusCode.OK and [r.token_id for r in p.replies] == reference
    wait_kv_idle(decode, prefill)


def test_prefill_server_restarted_while_decode_is_idle(slow_pair: dict[str, Server]) -> None:
    """The decode server still holds the old pairing; the new process asks for a handshake
    (FAILED_PRECONDITION), and the decode server handshakes again without failing the request."""
    decode, prefill = slow_pair["decode"], slow_pair["prefill"]
    assert tokens(decode.address, request(40, 4)) == tokens(decode.address, request(40, 4, prefill_mode=COLOC))
    prefill.signal(signal.SIGTERM)
    assert prefill.wait(15) == 0
    prefill = slow_pair["prefill"] = prefill.restarted().start()
    assert tokens(decode.address, request(40, 4)) == tokens(decode.address, request(40, 4, prefill_mode=COLOC))
    assert "retrying once with a fresh handshake" in decode.log()
    wait_kv_idle(decode, prefill)


def test_sigterm_drains_both_servers(slow_pair: dict[str, Server]) -> None:
    """Last in this file. SIGTERM with streams in flight: health NOT_SERVING, new requests
    UNAVAILABLE, every in-flight stream finishes, exit 0 within the grace period."""
    decode, prefill = slow_pair["decode"], slow_pair["prefill"]
    # 400 tokens each outlast the remote prefill; on a 2-core CI runner they end ~15 s after the signal
    streams = [Pending(decode.address, request(40 + i, 400, salt=i, prefill_mode=COLOC), timeout=60)
               for i in range(3)]
    wait_until(lambda: all(p.replies for p in streams), 10)
    remote = Pending(decode.address, request(300, 200), timeout=60)  # in the (slow) prefill server
    wait_until(lambda: prefill.metrics()["num_requests_running"] == 1, 5)
    signalled = time.monotonic()
    decode.signal(signal.SIGTERM)
    prefill.signal(signal.SIGTERM)
    wait_until(lambda: health_status(decode.address) == "NOT_SERVING", 3)
    wait_until(lambda: health_status(prefill.address) == "NOT_SERVING", 3)
    assert all(p.code is None for p in [*streams, remote])  # still streaming while draining
    late = Pending(decode.address, request(20, 4, prefill_mode=COLOC)).result()
    assert late.code == UNAVAILABLE and "shutting down" in late.details
    for p in [*streams, remote]:
        p.result(60)
        assert p.code == grpc.StatusCode.OK, (p.code, p.details)
        assert p.replies[-1].finish_reason == "length" and len(p.replies) in (400, 200)
    assert decode.wait(30) == 0 and prefill.wait(30) == 0
    assert time.monotonic() - signalled < 30  # --drain-timeout-s default
