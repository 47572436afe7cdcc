"""The one launcher (python -m launcher) as `make serve-prefill serve-decode stop` drives it: servers in
the background with pid and log files, a second start that finds them running, a failed start
that shows why, and a stop that waits for them to exit; servers started with TLS or mutual TLS probed
with their own credentials."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from client.wait_ready import Probe, is_serving, probe_for
from launcher.process import pid_alive
from tests.servers import ROOT, free_port
from tests.test_mtls import CA
from tests.test_tls import self_signed

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
    proc = subprocess.run([sys.executable, "-m", "launcher", "start", "prefill", "prefill_server",
                           "--address", f"127.0.0.1:{port}", "--run-dir", str(tmp_path), "--", "--port", str(port),
                           "--device", "cpu", "--metrics-port", "0", "--model", str(tmp_path / "nope")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "exited with 2 before it was ready" in proc.stderr
    assert "no such folder" in proc.stderr  # the server's own one-line reason, from its log


def test_the_probe_follows_the_servers_own_flags(tmp_path: Path) -> None:
    cert, key, ca, client_ca = (tmp_path / n for n in ("s.pem", "s.key", "ca.pem", "clients.pem"))
    own = ["--tls-cert", str(cert), "--tls-key", str(key)]
    assert probe_for("127.0.0.1:5", ["--port", "5"]) == Probe("127.0.0.1:5")
    assert probe_for("127.0.0.1:5", [*own, "--health-port", "9"]) == Probe("127.0.0.1:9")  # plaintext health
    assert probe_for("h:5", [*own, "--tls-ca", str(ca)]) == Probe("h:5", (ca, cert))
    mutual = probe_for("h:5", [*own, "--tls-client-ca", str(client_ca)])  # presents its own certificate
    assert mutual == Probe("h:5", (client_ca, cert), cert, key)
    decode = probe_for("h:5", [*own, "--tls-client-ca", str(client_ca), "--tls-ca", str(ca), "--tls-client-cert",
                               "c.pem", "--tls-client-key", "c.key"])
    assert decode == Probe("h:5", (ca, client_ca, cert), Path("c.pem"), Path("c.key"))
    assert probe_for("h:5", ["--tls-ca", str(ca)]) == Probe("h:5")  # a decode server's CA for its peers: no TLS here


def serve_scenario_stop(run_dir: Path, prefill_args: str, decode_args: str, *scenario_args: str,
                        check_prefill: Callable[[str], None] = lambda address: None) -> None:
    """`make serve-prefill serve-decode` with these flags ready in under 60 s, client.scenario served,
    `check_prefill(its address)` while it serves, `make stop`."""
    ports = {"PREFILL_PORT": str(free_port()), "DECODE_PORT": str(free_port()), "PREFILL_METRICS_PORT": "0",
             "DECODE_METRICS_PORT": "0", "HTTP_PORT": "0", "PREFILL_ARGS": f"--device cpu {prefill_args}",
             "DECODE_ARGS": f"--device cpu {decode_args}"}
    started_at = time.monotonic()
    started = make(run_dir, "serve-prefill", "serve-decode", **ports)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert time.monotonic() - started_at < 60 and started.stdout.count("is SERVING") == 2
        assert "WRONG_VERSION_NUMBER" not in (run_dir / "prefill.log").read_text()  # never probed in plaintext
        scenario = subprocess.run([sys.executable, "-m", "client.scenario", "--target",
                                   f"127.0.0.1:{ports['DECODE_PORT']}", "--b-len", "128", "--a-len", "32",
                                   "--a-new-tokens", "22", "--modes", "alone,disaggregated", *scenario_args],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert scenario.returncode == 0, scenario.stderr
        check_prefill(f"127.0.0.1:{ports['PREFILL_PORT']}")
    finally:
        stopped = make(run_dir, "stop")
    assert stopped.returncode == 0 and "prefill server stopped" in stopped.stdout
    assert not list(run_dir.glob("*.pid"))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serves_both_servers_over_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    tls = f"--tls-cert {cert} --tls-key {key}"

    def wait_ready_speaks_tls(address: str) -> None:
        for flags, code in (([], 1), (["--tls-ca", str(cert)], 0)):
            proc = subprocess.run([sys.executable, "-m", "client.wait_ready", address, "--timeout", "2", *flags],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert proc.returncode == code, proc.stderr

    serve_scenario_stop(tmp_path, tls, f"{tls} --tls-ca {cert}", "--tls-ca", str(cert),
                        check_prefill=wait_ready_speaks_tls)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serves_with_mutual_tls_between_the_servers(tmp_path: Path) -> None:
    ca = CA(tmp_path, "pd")
    prefill, decode, stranger = ca.issue("prefill"), ca.issue("decode"), CA(tmp_path, "other").issue("client")

    def only_the_cas_clients_are_served(address: str) -> None:
        assert is_serving(Probe(address, (ca.path,), decode.cert, decode.key))
        assert not is_serving(Probe(address, (ca.path,)))                                 # no client certificate
        assert not is_serving(Probe(address, (ca.path,), stranger.cert, stranger.key))    # another CA's
        assert not is_serving(address)                                                    # plaintext

    serve_scenario_stop(tmp_path, f"--tls-cert {prefill.cert} --tls-key {prefill.key} --tls-client-ca {ca.path}",
                        f"--tls-ca {ca.path} --tls-client-cert {decode.cert} --tls-client-key {decode.key}",
                        check_prefill=only_the_cas_clients_are_served)
