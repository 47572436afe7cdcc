"""Real server processes on free loopback ports, for tests (started by the launcher)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
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


def refused_at_pairing(address: str, prompt: list[int]) -> str:
    """A disaggregated request to the decode server at `address`, whose prefill server does not pair with it:
    refused with FAILED_PRECONDITION; its one line."""
    import grpc
    import pytest
    from pd.v1 import decode_pb2, decode_pb2_grpc

    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
        list(decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
            token_ids=prompt, max_new_tokens=2, prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=60))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    details = e.value.details()  # type: ignore[attr-defined]
    assert isinstance(details, str)
    return details


@contextmanager
def served_pair(args: list[str], log_dir: Path) -> Iterator[str]:
    """A prefill server and a decode server paired with it, both started with `args`; yields the decode
    server's address."""
    prefill = ServerProcess("prefill_server", args, log_dir).start()
    try:
        decode = ServerProcess("decode_server", [*args, "--prefill-addr", prefill.address], log_dir).start()
        try:
            yield decode.address
        finally:
            decode.stop()
    finally:
        prefill.stop()


@contextmanager
def pair_and_stranger(prefill_args: list[str], decode_args: list[str], stranger_args: list[str],
                      log_dir: Path) -> Iterator[tuple[str, str]]:
    """A prefill server, a decode server that pairs with it and one that should not (both given its
    address); yields the two decode servers' addresses."""
    prefill = ServerProcess("prefill_server", prefill_args, log_dir).start()
    try:
        pair = ["--prefill-addr", prefill.address]
        decode = ServerProcess("decode_server", [*decode_args, *pair], log_dir).start()
        try:
            stranger = ServerProcess("decode_server", [*stranger_args, *pair], log_dir).start()
            try:
                yield decode.address, stranger.address
            finally:
                stranger.stop()
        finally:
            decode.stop()
    finally:
        prefill.stop()
