"""Shared by the HTTP API tests (loaded with `pytest_plugins`): a decode server (tiny preset, CPU,
colocated) with its OpenAI HTTP API and a Prometheus port, and an `openai` SDK client for it.

There are no tests in this module; the server is session-scoped so one serves every file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from tests.servers import free_port
from tests.test_reliability_fixtures import Server


class HttpServer(Server):
    """A decode server with its HTTP API on `http_port`."""

    def __init__(self, log_dir: Path, *args: str) -> None:
        self.http_port = free_port()
        super().__init__("decode_server", ["--http-port", str(self.http_port), "--chunk-size", "32", *args], log_dir)

    def spawn(self, detach: bool = False) -> None:
        self.log_start = len(self.log())  # a log file of an earlier server on the same port is appended to
        super().spawn(detach)

    def own_log(self) -> str:
        """What this server wrote to its log."""
        return self.log()[self.log_start:]

    @property
    def device(self) -> str:
        """Its --device: a preset's random weights are drawn by that device's generator, so a reference
        computed elsewhere is another model."""
        flags = self.args[::-1]  # argparse takes the last --device given
        return flags[flags.index("--device") - 1] if "--device" in flags else "cpu"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def client(self, **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def http_server(server_logs: Path) -> Iterator[HttpServer]:
    server = HttpServer(server_logs).start()
    yield server
    server.stop()


def approx_logprobs(expected: Sequence[float | None]) -> object:
    """Log probabilities of the same tokens from two runs: equal up to float rounding. The runs batch rows and reuse
    cached prompt blocks differently, so a sum may round differently in its last bits."""
    return pytest.approx(expected, abs=1e-4)
