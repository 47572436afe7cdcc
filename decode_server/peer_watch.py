"""How the decode server finds a frozen or cut-off prefill server in seconds, and takes it back.

A prefill server writes to every Prefill stream at least every HEARTBEAT_S (a Heartbeat when it has
nothing else to send), so a stream quiet for `SILENCE_S` means the server is stopped, frozen or out
of reach; the request leaves it then, not at the HTTP/2 keepalive (20 s) or its deadline. The server
is taken out of the rotation and probed with health checks until it answers SERVING again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# The prefill server's heartbeat is every 0.5 s: four missed ones is not a slow event loop.
SILENCE_S = 2.0
PROBE_EVERY_S = 0.5


class Silent(Exception):
    """The stream said nothing for `SILENCE_S`."""


async def until_silent(stream: AsyncIterable[T], silence_s: float = SILENCE_S) -> AsyncIterator[T]:
    """The stream's messages; Silent once none comes for `silence_s`."""
    it = stream.__aiter__()
    while True:
        try:
            message = await asyncio.wait_for(it.__anext__(), silence_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise Silent(f"no message for {silence_s:.0f}s (the server is frozen, stopped or cut off)") from None
        yield message


class PeerHealth:
    """Whether a prefill server takes new prefills. `down()` takes it out until a health check on its
    channel says SERVING again (probed every PROBE_EVERY_S)."""

    def __init__(self, address: str, channel: grpc.aio.Channel) -> None:
        self.address = address
        self._health = health_pb2_grpc.HealthStub(channel)
        self.down_since: float | None = None
        self._probe: asyncio.Task[None] | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def down(self, why: str) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        log.warning("prefill server %s out of the rotation: %s", self.address, why)
        self._probe = asyncio.get_running_loop().create_task(self._until_serving())

    async def _until_serving(self) -> None:
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            try:
                reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_EVERY_S)
            except grpc.aio.AioRpcError:
                continue
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                assert self.down_since is not None
                log.info("prefill server %s is back after %.1fs", self.address, time.monotonic() - self.down_since)
                self.down_since = None
                return

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
