"""Shared by the reliability, metrics, fuzz and soak tests (each loads it with `pytest_plugins`):
real server processes with Prometheus ports, and helpers that read the KV pools through them.

There are no tests in this module; its fixtures are session-scoped so one pair serves every file.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import decode_pb2
from prometheus_client.parser import text_string_to_metric_families

from launcher.process import start_all, stop_all
from tests.servers import ServerProcess, free_port


class Server(ServerProcess):
    """A ServerProcess with its own Prometheus port, extra environment, and optional TLS readiness."""

    def __init__(self, module: str, args: list[str], log_dir: Path, port: int | None = None,
                 metrics_port: int | None = None, env: dict[str, str] | None = None,
                 tls_ca: bytes | None = None, host: str | None = "127.0.0.1") -> None:
        super().__init__(module, args, log_dir, port)
        self.metrics_port = metrics_port or free_port()
        self.args += ["--metrics-port", str(self.metrics_port)]  # argparse keeps the last one
        if host is None:  # leave --host to the server's default
            i = self.args.index("--host")
            del self.args[i:i + 2]
        self.env = env or {}
        self.tls_ca = tls_ca

    def ready(self) -> bool:
        return health_status(self.address, self.tls_ca) == "SERVING"

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def restarted(self) -> Server:
        """A new process with the same flags, ports and environment (not started)."""
        again = Server(self.module, [], self.log_path.parent, port=self.port, metrics_port=self.metrics_port,
                       env=self.env, tls_ca=self.tls_ca)
        again.args = list(self.args)
        return again


def secure_channel(address: str, ca: bytes) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca))


def health_status(address: str, tls_ca: bytes | None = None, timeout: float = 0.5) -> str:
    """SERVING, NOT_SERVING, or the gRPC code's name when the check itself fails."""
    ch = secure_channel(address, tls_ca) if tls_ca else grpc.insecure_channel(address)
    with ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name  # type: ignore[no-any-return, attr-defined]
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def scrape(port: int) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, keyed `name` or `name{label="value",...}`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
    """Seconds until `predicate()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
    return time.monotonic() - start


def kv_idle(server: Server) -> bool:
    """Every KV block free and nothing running or waiting (decode) / in progress (prefill)."""
    m = server.metrics()
    return (m["kv_cache_free_blocks"] == m["kv_cache_total_blocks"] and m["num_requests_running"] == 0
            and m["num_requests_waiting"] == 0)


def wait_kv_idle(*servers: Server, timeout: float = 5.0) -> float:
    """Seconds until every server's KV pool is entirely free again."""
    return wait_until(lambda: all(kv_idle(s) for s in servers), timeout)


def prompt(n: int, salt: int = 0, vocab: int = 256) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % vocab for i in range(n)]


def request(n: int = 20, new: int = 8, salt: int = 0, **fields: object) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(token_ids=prompt(n, salt), max_new_tokens=new, ignore_eos=True,
                                      **fields)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def rel_pair(server_logs: Path) -> Iterator[tuple[Server, Server]]:
    """(decode, prefill), tiny preset on CPU, paired over gRPC, both with a Prometheus port."""
    prefill = Server("prefill_server", [], server_logs)
    decode = Server("decode_server", ["--prefill-addr", prefill.address, "--chunk-size", "32"], server_logs)
    start_all([prefill, decode])  # the decode server pairs on its first disaggregated request
    yield decode, prefill
    stop_all([decode, prefill])
