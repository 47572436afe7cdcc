"""A frozen (SIGSTOPped) prefill server is found in seconds, with real processes on the CPU.

Alone, it fails the request stuck on it, and those sent to it while frozen, UNAVAILABLE within 5 s of
the freeze (not at the HTTP/2 keepalive, 20 s); a shorter client deadline still ends DEADLINE_EXCEEDED
on time. With a second prefill server, the stuck request is prefilled again there and ends OK, new
requests go there meanwhile, and the thawed server is used again. No KV is left taken anywhere.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from tests.test_reliability_fixtures import Server, start_all, stop_all, wait_kv_idle, wait_until

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

FOUND_WITHIN_S = 5.0   # the contract: a request stuck on a frozen prefill server ends within this of the freeze
RETRY_S = 3.0          # and its prefill again on another server, on a loaded shared CPU
SLOW_LAYERS = {"PD_FAULT_PREFILL_LAYER_DELAY_S": "0.5"}  # 3 layers: a prefill of 1.5 s, long enough to freeze in
PREFILL_OK = 'prefill_requests_total{status="OK"}'


class Outcome:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended = 0.0  # monotonic


def send(decode: Server, n: int, timeout: float) -> tuple[threading.Thread, Outcome]:
    outcome = Outcome()
    req = decode_pb2.GenerateRequest(token_ids=[(i * 7) % 256 for i in range(n)], max_new_tokens=4,
                                     prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED)

    def run() -> None:
        with grpc.insecure_channel(decode.address) as ch:
            try:
                list(decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=timeout))
                outcome.code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                outcome.code, outcome.details = e.code(), e.details()  # type: ignore[attr-defined]
        outcome.ended = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def running(server: Server) -> bool:
    return server.metrics()["num_requests_running"] > 0


def test_alone_a_frozen_prefill_server_fails_requests_within_seconds(server_logs: Path) -> None:
    prefill = Server("prefill_server", [], server_logs, env=SLOW_LAYERS)
    decode = Server("decode_server", ["--prefill-addr", prefill.address], server_logs)
    start_all([prefill, decode])
    try:
        stuck, stuck_outcome = send(decode, 200, timeout=60)
        wait_until(lambda: running(prefill), timeout=10)
        prefill.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        during, during_outcome = send(decode, 50, timeout=60)
        short, short_outcome = send(decode, 50, timeout=1.0)
        for thread in (stuck, during, short):
            thread.join(30)
        for outcome in (stuck_outcome, during_outcome):
            assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
            assert "prefill server" in outcome.details
            assert outcome.ended - frozen_at < FOUND_WITHIN_S, outcome.ended - frozen_at
        assert short_outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert short_outcome.ended - frozen_at < 2.5
        wait_kv_idle(decode, timeout=5)
        prefill.signal(signal.SIGCONT)
        wait_kv_idle(decode, prefill, timeout=10)
        after, after_outcome = send(decode, 50, timeout=30)  # it rejoins at its next health check
        after.join(40)
        assert after_outcome.code == grpc.StatusCode.OK, after_outcome.details
    finally:
        prefill.signal(signal.SIGCONT)
        stop_all([decode, prefill])


def test_with_two_the_stuck_request_is_prefilled_again_on_the_other(server_logs: Path) -> None:
    victim = Server("prefill_server", [], server_logs, env=SLOW_LAYERS)
    other = Server("prefill_server", [], server_logs)
    decode = Server("decode_server", ["--prefill-addr", f"{victim.address},{other.address}"], server_logs)
    start_all([victim, other, decode])
    try:
        # requests alternate between the two: send until one is prefilling on the slow one
        for _ in range(6):
            stuck, stuck_outcome = send(decode, 200, timeout=60)
            try:
                wait_until(lambda: running(victim), timeout=1.5)
                break
            except AssertionError:
                stuck.join(30)
        assert running(victim), "no request reached the victim"
        victim.signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        stuck.join(30)
        assert stuck_outcome.code == grpc.StatusCode.OK, stuck_outcome.details
        assert stuck_outcome.ended - frozen_at < FOUND_WITHIN_S + RETRY_S, stuck_outcome.ended - frozen_at
        # while it is frozen, requests go to the other at once
        during = [send(decode, 50, timeout=60) for _ in range(3)]
        for thread, outcome in during:
            thread.join(30)
            assert outcome.code == grpc.StatusCode.OK and outcome.ended - frozen_at < FOUND_WITHIN_S + 2 * RETRY_S
        victim.signal(signal.SIGCONT)
        before = victim.metrics().get(PREFILL_OK, 0.0)
        wait_kv_idle(decode, victim, other, timeout=10)
        deadline = time.monotonic() + 10
        while victim.metrics().get(PREFILL_OK, 0.0) == before:  # the thawed server takes prefills again
            assert time.monotonic() < deadline, "the thawed prefill server was not used again"
            thread, outcome = send(decode, 50, timeout=30)
            thread.join(40)
            assert outcome.code == grpc.StatusCode.OK, outcome.details
        wait_kv_idle(decode, victim, other, timeout=10)
    finally:
        victim.signal(signal.SIGCONT)
        stop_all([decode, victim, other])
