"""A server process: `python -m MODULE FLAGS...` spawned, waited on until its gRPC health says SERVING
(asked as its own flags say: over TLS with its certificates, or on its plaintext --health-port), and
stopped; several at once with `start_all` / `stop_all`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from client.wait_ready import is_serving, probe_for

ROOT = Path(__file__).resolve().parent.parent  # where `python -m decode_server` resolves


class ServerFailed(RuntimeError):
    """The server exited, or did not serve in time; the message carries its log's last lines."""


class ServerProcess:
    """`python -m <module> <args>`, its output in `log_path`, its gRPC health checked at `address` with
    the credentials its `args` give it (client.wait_ready.probe_for)."""

    def __init__(self, module: str, args: list[str], address: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.module, self.args, self.address, self.log_path = module, args, address, log_path
        self.env = env or {}  # on top of this process's environment
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, detach: bool = False) -> None:
        """Start it without waiting; `detach` lets it outlive this process (its own session)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=detach)

    def wait_serving(self, timeout: float) -> Self:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"{self.module} on {self.address} exited with {self.proc.returncode} before "
                                   f"it was ready:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.1)
        raise ServerFailed(f"{self.module} on {self.address} not SERVING after {timeout:.0f}s (log: "
                           f"{self.log_path}):\n{self.log_tail()}")

    def start(self, timeout: float = 600.0) -> Self:
        self.spawn()
        return self.wait_serving(timeout)

    def ready(self) -> bool:
        return is_serving(probe_for(self.address, self.args), timeout=0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the server drains), and SIGKILL if it has not exited after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_all(servers: Sequence[ServerProcess], timeout: float = 600.0) -> None:
    """Start them together (start-up is mostly imports and model loading), then wait for each; if
    one fails, every one is killed."""
    try:
        for server in servers:
            server.spawn()
        for server in servers:
            server.wait_serving(timeout)
    except BaseException:
        for server in servers:
            server.kill()
        raise


def stop_all(servers: Sequence[ServerProcess], timeout: float = 30.0) -> None:
    """SIGTERM them all first, so they drain at the same time, then wait for each."""
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            server.signal(signal.SIGTERM)
    for server in servers:
        server.stop(timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
