"""A second user as a second client: a process of its own, with its own channel, that sends one
prepared request when told and hands back what it saw. Sent from the first user's own event loop,
the second request's set-up and stream delayed the first user's tokens in the client itself
(about 3.5 ms on one H200), a cost no real pair of users has.

Times are `time.perf_counter()`, which on Linux reads the same clock in every process of a host."""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import fields
from multiprocessing.connection import Connection
from typing import Any

import grpc
from pd.v1 import decode_pb2, decode_pb2_grpc

from client.stream import READY_TIMEOUT_S, StreamResult, Unreachable, collect, open_channel, wait_ready


class SecondUser:
    def __init__(self, target: str, tls_ca: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of the parent's event loop or channels
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, target, tls_ca), daemon=True,
                                        name="second-user")
        self._process.start()
        child.close()
        if not self._conn.poll(READY_TIMEOUT_S) or self._conn.recv() != "ready":
            raise RuntimeError(f"the second user's process could not reach {target}")

    def prepare(self, request: decode_pb2.GenerateRequest) -> None:
        """The request `send_now` sends: parsed in the other process ahead of time."""
        self._conn.send(("prepare", request.SerializeToString()))

    def send_now(self) -> None:
        self._conn.send(("send",))

    async def result(self) -> StreamResult:
        """What the second user saw of its request, once its stream has ended."""
        reply: dict[str, Any] = await asyncio.get_running_loop().run_in_executor(None, self._conn.recv)
        for key in ("first", "last"):
            if reply[key] is not None:
                reply[key] = decode_pb2.GenerateResponse.FromString(reply[key])
        reply["error"] = grpc.StatusCode[reply["error"]] if reply["error"] else None
        return StreamResult(**reply)

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(("stop",))
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def __enter__(self) -> SecondUser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(conn: Connection, target: str, tls_ca: str | None) -> None:
    from client.event_loop import run_event_loop

    run_event_loop(_main(conn, target, tls_ca))


async def _main(conn: Connection, target: str, tls_ca: str | None) -> None:
    loop = asyncio.get_running_loop()
    channel = open_channel(target, tls_ca)
    try:
        await wait_ready(channel, target, lambda line: None)  # the first user says it waits
    except Unreachable:
        conn.send("unreachable")
        return
    conn.send("ready")
    stub = decode_pb2_grpc.DecodeStub(channel)
    request = decode_pb2.GenerateRequest()
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command[0] == "prepare":
            request = decode_pb2.GenerateRequest.FromString(command[1])
        elif command[0] == "send":
            conn.send(_to_wire(await collect(stub, request)))
        else:
            break
    await channel.close()


def _to_wire(result: StreamResult) -> dict[str, Any]:
    """The result with its messages as bytes and its status code as a name (what a pipe carries)."""
    out = {f.name: getattr(result, f.name) for f in fields(result)}
    for key in ("first", "last"):
        message = getattr(result, key)
        out[key] = message.SerializeToString() if message is not None else None
    out["error"] = result.error.name if result.error is not None else None
    return out
