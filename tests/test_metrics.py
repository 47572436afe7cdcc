"""Observability against real processes: the Prometheus names serving users know, really updated,
scraped over HTTP from both servers; and one JSON log line per finished request."""

from __future__ import annotations

import json

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from tests.test_reliability_fixtures import Server, request, wait_kv_idle, wait_until

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures"]

DISAGG, COLOC, CHUNKED = (decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED,
                          decode_pb2.PREFILL_MODE_CHUNKED)
HISTOGRAMS_DECODE = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds", "prefill_seconds", "kv_transfer_seconds", "decode_step_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_cache_free_blocks",
          "kv_cache_total_blocks"]


def generate(address: str, req: decode_pb2.GenerateRequest, cancel_after: int | None = None) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=30)
        try:
            for n, _ in enumerate(stream, 1):
                if n == cancel_after:
                    stream.cancel()
        except grpc.RpcError as e:
            return e.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_are_named_and_updated(rel_pair: tuple[Server, Server]) -> None:
    decode, prefill = rel_pair
    wait_kv_idle(decode, prefill)
    d0, p0 = decode.metrics(), prefill.metrics()
    for mode in (DISAGG, COLOC, CHUNKED):  # a prompt no other test sends: the remote one finds no cached prefix
        assert generate(decode.address, request(100, 6, salt=77, prefill_mode=mode)) == grpc.StatusCode.OK
    stop_at = decode_pb2.GenerateRequest(token_ids=[7, 8, 9], max_new_tokens=50, stop_token_ids=list(range(320)))
    assert generate(decode.address, stop_at) == grpc.StatusCode.OK  # ends on its first token: "stop"
    assert generate(decode.address, request(100, 5000, prefill_mode=COLOC), cancel_after=3) == \
        grpc.StatusCode.CANCELLED
    assert generate(decode.address, request(10, 0)) == grpc.StatusCode.INVALID_ARGUMENT
    wait_kv_idle(decode, prefill)
    d1, p1 = decode.metrics(), prefill.metrics()

    for name in HISTOGRAMS_DECODE:
        assert f"{name}_bucket{{le=\"+Inf\"}}" in d1, name
    assert delta(d1, d0, "time_to_first_token_seconds_count") == 5
    assert delta(d1, d0, "inter_token_latency_seconds_count") >= 3 * 5 + 2
    assert delta(d1, d0, "e2e_request_latency_seconds_count") == 4  # the successes
    assert delta(d1, d0, "request_queue_time_seconds_count") == 5
    assert delta(d1, d0, "prefill_seconds_count") == 5  # remote (1 + the stop one) and local (3)
    assert delta(d1, d0, "kv_transfer_seconds_count") == 2
    assert delta(d1, d0, 'kv_transfer_bytes_total{transport="grpc"}') == (100 + 3) * 4 * 2 * 2 * 16 * 4
    assert delta(d1, d0, 'request_success_total{finish_reason="length"}') == 3
    assert delta(d1, d0, 'request_success_total{finish_reason="stop"}') == 1
    assert delta(d1, d0, 'request_failure_total{code="CANCELLED"}') == 1
    assert delta(d1, d0, 'request_failure_total{code="INVALID_ARGUMENT"}') == 1
    assert delta(d1, d0, "decode_step_seconds_count") > 0
    for name in GAUGES:
        assert name in d1, name
    assert d1["kv_cache_usage_perc"] == 0.0 and d1["kv_cache_free_blocks"] == d1["kv_cache_total_blocks"] > 0

    assert delta(p1, p0, "prefill_seconds_count") == 2
    assert delta(p1, p0, "kv_transfer_seconds_count") == 2
    assert delta(p1, p0, 'kv_transfer_bytes_total{transport="grpc"}') == (100 + 3) * 1024
    assert delta(p1, p0, "kv_streamed_bytes_total") == (100 + 3) * 1024
    assert delta(p1, p0, 'prefill_requests_total{status="OK"}') == 2
    for name in GAUGES:
        assert name in p1, name


def test_gauges_follow_a_running_request(rel_pair: tuple[Server, Server]) -> None:
    decode, prefill = rel_pair
    wait_kv_idle(decode, prefill)
    with grpc.insecure_channel(decode.address) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(request(100, 3000, prefill_mode=COLOC), timeout=30)
        next(stream)
        m = decode.metrics()
        assert m["num_requests_running"] == 1 and m["num_requests_waiting"] == 0
        used = m["kv_cache_total_blocks"] - m["kv_cache_free_blocks"]
        assert used == -(-3100 // 16)  # every block the request can need, reserved up front
        assert abs(m["kv_cache_usage_perc"] - used / m["kv_cache_total_blocks"]) < 1e-9
        stream.cancel()
    wait_kv_idle(decode, prefill)


def request_lines(log: str) -> dict[str, dict[str, object]]:
    lines = {}
    for line in log.splitlines():
        if "decode_server.requests: " in line:
            record = json.loads(line.split("decode_server.requests: ", 1)[1])
            lines[str(record["request_id"])] = record
    return lines


def test_one_json_log_line_per_finished_request(rel_pair: tuple[Server, Server]) -> None:
    decode, prefill = rel_pair
    assert generate(decode.address, request(30, 5, request_id="log-ok")) == grpc.StatusCode.OK
    assert generate(decode.address, request(30, 5000, request_id="log-cancel", prefill_mode=COLOC),
                    cancel_after=2) == grpc.StatusCode.CANCELLED
    assert generate(decode.address, request(30, 0, request_id="log-bad")) == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: {"log-ok", "log-cancel", "log-bad"} <= request_lines(decode.log()).keys(), 5)
    log = decode.log()
    records = request_lines(log)
    ok, cancelled, bad = records["log-ok"], records["log-cancel"], records["log-bad"]
    assert ok["status"] == "OK" and ok["finish_reason"] == "length" and ok["output_tokens"] == 5
    assert ok["mode"] == "disaggregated" and ok["prompt_tokens"] == 30
    assert isinstance(ok["ttft_s"], float) and isinstance(ok["e2e_s"], float) and float(ok["kv_transfer_s"]) > 0  # type: ignore[arg-type]
    assert cancelled["status"] == "CANCELLED" and cancelled["finish_reason"] == "" and cancelled["mode"] == "colocated"
    assert bad["status"] == "INVALID_ARGUMENT"
    for rid in ("log-ok", "log-cancel", "log-bad"):
        assert log.count(f'"request_id": "{rid}"') == 1
    assert float(ok["prefill_queue_s"]) >= 0 and float(ok["kv_exposed_s"]) >= 0  # type: ignore[arg-type]
    # the prefill server's own line for the same request: where its time went
    wait_until(lambda: '"request_id": "log-ok"' in prefill.log(), 5)
    line = next(x for x in prefill.log().splitlines() if '"request_id": "log-ok"' in x)
    remote = json.loads(line.split("prefill_server.requests: ", 1)[1])
    assert remote["event"] == "prefill_finished" and remote["prompt_tokens"] == 30 and remote["transport"] == "grpc"
    assert remote["prefill_s"] == pytest.approx(ok["prefill_s"], abs=1e-5)
    assert min(remote["queue_s"], remote["setup_s"], remote["kv_send_s"], remote["checksum_s"]) >= 0
