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


def assert_disaggregated_tokens(address: str, prompts: list[list[int]], want: list[list[int]], steps: int) -> None:
    """Each prompt, prefilled remotely through the decode server at `address`, gives `want`'s greedy tokens."""
    import grpc
    from pd.v1 import decode_pb2, decode_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        for prompt, tokens in zip(prompts, want, strict=True):
            replies = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                token_ids=prompt, max_new_tokens=steps, ignore_eos=True,
                prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=60)
            assert [r.token_id for r in replies] == tokens
