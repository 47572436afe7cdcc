"""Real server processes on free loopback ports, for tests (started by the launcher)."""

from __future__ import annotations

import socket
from pathlib import Path

from launcher.process import ROOT
from launcher.process import ServerProcess as LaunchedServer

__all__ = ["ROOT", "ServerProcess", "free_port", "free_port_run"]


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


class ServerProcess(LaunchedServer):
    """`python -m <module> --port <free> ...` on loopback, metrics off, on `device`, logging into `log_dir`."""

    def __init__(self, module: str, args: list[str], log_dir: Path, port: int | None = None,
                 device: str = "cpu") -> None:
        self.port = port or free_port()
        http_off = ["--http-port", "0"] if module == "decode_server" else []  # a test that wants it passes one
        super().__init__(module, ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0", *http_off,
                                  "--device", device, *args],
                         f"127.0.0.1:{self.port}", log_dir / f"{module}-{self.port}.log")
