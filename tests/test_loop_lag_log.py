"""With --loop-lag-probe-ms the decode server logs, per request, the longest wait of work handed to
its event loop and the longest garbage-collector pass, from the request's arrival to its first
token; and it freezes what start-up built before it serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from launcher.process import start_all, stop_all
from tests.test_reliability_fixtures import Server, wait_until

pytestmark = pytest.mark.e2e  # starts a server process


def finished(log: str, request_id: str) -> dict[str, Any] | None:
    for line in log.splitlines():
        if '"event": "request_finished"' in line and f'"request_id": "{request_id}"' in line:
            return json.loads(line[line.index("{"):])  # type: ignore[no-any-return]
    return None


def test_the_request_log_has_the_loop_lag_and_the_longest_collector_pass(server_logs: Path) -> None:
    decode = Server("decode_server", ["--loop-lag-probe-ms", "0.5"], server_logs)
    start_all([decode])
    try:
        request = decode_pb2.GenerateRequest(request_id="lagged", token_ids=list(range(200)), max_new_tokens=4,
                                             ignore_eos=True)
        with grpc.insecure_channel(decode.address) as channel:
            assert len(list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60))) == 4
        wait_until(lambda: finished(decode.log(), "lagged") is not None, timeout=10)
        entry = finished(decode.log(), "lagged")
        assert entry is not None
        assert 0 <= entry["loop_lag_max_s"] <= entry["e2e_s"]
        assert 0 <= entry["gc_pause_max_s"] <= entry["e2e_s"]
        assert "start-up objects frozen" in decode.log()
    finally:
        stop_all([decode])
