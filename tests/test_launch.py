"""The one launcher (serving.launch) as `make serve-prefill serve-decode stop` drives it: servers in
the background with pid and log files, a second start that finds them running, a failed start
that shows why, and a stop that waits for them to exit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from serving.launch import pid_alive
from tests.servers import ROOT, free_port

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)


def make(run_dir: Path, *targets: str, **variables: str) -> subprocess.CompletedProcess[str]:
    assignments = [f"{k}={v}" for k, v in {"PYTHON": sys.executable, "RUN_DIR": str(run_dir), **variables}.items()]
    return subprocess.run(["make", "--no-print-directory", *targets, *assignments], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_and_stop(tmp_path: Path) -> None:
    ports = {"PREFILL_PORT": str(free_port()), "DECODE_PORT": str(free_port()), "PREFILL_METRICS_PORT": "0",
             "DECODE_METRICS_PORT": "0", "PREFILL_ARGS": "--device cpu --preset tiny",
             "DECODE_ARGS": "--device cpu --preset tiny"}
    started = make(tmp_path, "serve-prefill", "serve-decode", **ports)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert started.stdout.count("is SERVING") == 2
        pids = [int((tmp_path / f"{name}.pid").read_text()) for name in ("prefill", "decode")]
        again = make(tmp_path, "serve-prefill", **ports)
        assert again.returncode == 0 and f"prefill server already running (pid {pids[0]})" in again.stdout
        with grpc.insecure_channel(f"127.0.0.1:{ports['DECODE_PORT']}") as ch:
            replies = list(decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                token_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True), timeout=60))
        assert len(replies) == 4
        assert "SERVING" in (tmp_path / "decode.log").read_text()
    finally:
        stopped = make(tmp_path, "stop")
    assert stopped.returncode == 0 and "decode server stopped" in stopped.stdout
    assert "prefill server stopped" in stopped.stdout
    assert not any(pid_alive(pid) for pid in pids)
    assert not list(tmp_path.glob("*.pid"))


def test_failed_start_shows_the_servers_reason(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "serving.launch", "start", "prefill", "prefill_server",
                           "--address", f"127.0.0.1:{port}", "--run-dir", str(tmp_path), "--", "--port", str(port),
                           "--device", "cpu", "--metrics-port", "0", "--model", str(tmp_path / "nope")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "exited with 2 before it was ready" in proc.stderr
    assert "no such folder" in proc.stderr  # the server's own one-line reason, from its log
