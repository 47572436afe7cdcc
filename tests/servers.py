"""Real server processes on free loopback ports, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import grpc

from client.wait_ready import is_serving

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports that are free now."""
    while True:
        base = free_port()
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


class ServerProcess:
    """`python -m <module> --port <free> ...` with its log in `log_dir`; waits for SERVING."""

    def __init__(self, module: str, args: list[str], log_dir: Path, port: int | None = None,
                 device: str = "cpu") -> None:
        self.module = module
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0", "--device", device,
                     *args]
        self.env: dict[str, str] = {}
        self.log_path = log_dir / f"{module}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Self:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log()}")
            if self.ready():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.module} on {self.address} not SERVING after {timeout}s:\n{self.log()}")

    def ready(self) -> bool:
        return is_serving(self.address, timeout=0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address)
