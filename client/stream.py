"""Client-side helpers shared by the scenario, the load generator and the CLI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pd.v1 import decode_pb2, decode_pb2_grpc

SOON_S = 3.0  # a server this slow to accept a connection is said to be awaited
READY_TIMEOUT_S = 60.0  # servers still loading their model get this long

# prefill_mode numbers by the name the decode server's --mode takes (the proto's PREFILL_MODE_<NAME>)
PREFILL_MODES = {v.name.removeprefix("PREFILL_MODE_").lower(): v.number
                 for v in decode_pb2.PrefillMode.DESCRIPTOR.values if v.number}


def open_channel(target: str, tls_ca: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None) -> grpc.aio.Channel:
    """`client_cert`/`client_key`: this client's certificate, for a server that requires one (mutual TLS)."""
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 256 << 20)]
    if tls_ca or client_cert:
        creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes() if tls_ca else None,
                                             Path(client_key).read_bytes() if client_key else None,
                                             Path(client_cert).read_bytes() if client_cert else None)
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=options)


@dataclass
class StreamResult:
    """What a client saw of one Generate stream; times are `time.perf_counter()` seconds."""

    sent_at: float
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    server_times: list[float] = field(default_factory=list)  # each token's ServerTiming.since_arrival_s
    text: str = ""
    finish_reason: str = ""
    last: decode_pb2.GenerateResponse | None = None
    first: decode_pb2.GenerateResponse | None = None
    error: grpc.StatusCode | None = None
    error_message: str = ""

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent_at

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def server_gaps(self) -> list[float]:
        """The gaps as the decode server stamped its tokens: no client or network in them."""
        return [b - a for a, b in zip(self.server_times, self.server_times[1:], strict=False)]

    def add(self, response: decode_pb2.GenerateResponse, arrived: float) -> None:
        if self.first is None:
            self.first = response
        self.tokens.append(response.token_id)
        self.arrivals.append(arrived)
        self.server_times.append(response.timing.since_arrival_s)
        self.text += response.text
        self.last = response
        self.finish_reason = response.finish_reason or self.finish_reason


async def stream_generate(stub: decode_pb2_grpc.DecodeStub, request: decode_pb2.GenerateRequest,
                          timeout: float | None = None) -> AsyncIterator[tuple[decode_pb2.GenerateResponse, float]]:
    """Yield (response, arrival time) as tokens come."""
    call = stub.Generate(request, timeout=timeout)
    async for response in call:
        yield response, time.perf_counter()


async def collect(stub: decode_pb2_grpc.DecodeStub, request: decode_pb2.GenerateRequest,
                  timeout: float | None = None) -> StreamResult:
    result = StreamResult(sent_at=time.perf_counter())
    try:
        async for response, arrived in stream_generate(stub, request, timeout):
            result.add(response, arrived)
    except grpc.aio.AioRpcError as e:
        result.error, result.error_message = e.code(), e.details() or ""
    return result


class Unreachable(RuntimeError):
    """No server accepted a connection at a target: the one line a client exits with."""


async def wait_ready(channel: grpc.aio.Channel, target: str, log: Callable[[str], object],
                     timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until `channel` connects, saying so after SOON_S; Unreachable after `timeout_s` (servers still loading
    their model are waited for; a wrong address or stopped servers end in one line)."""
    try:
        await asyncio.wait_for(channel.channel_ready(), min(SOON_S, timeout_s))
        return
    except TimeoutError:
        log(f"waiting up to {timeout_s:.0f} s for a server at {target} ...")
    try:
        await asyncio.wait_for(channel.channel_ready(), max(0.0, timeout_s - SOON_S))
    except TimeoutError:
        raise Unreachable(f"no server accepts connections at {target} (waited {timeout_s:.0f} s); start the "
                          "servers (make serve-prefill serve-decode) or pass --target") from None
