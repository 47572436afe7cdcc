"""The decode side of a cuda-ipc handoff copies layers as the prefill side reports them: a report
of layer l means layers 0..l are readable, reports may skip layers, and the copies of one handoff
go to the writer thread in as few calls as the reports allow (each call waits for the GIL under
load). The receiver here is a stand-in that records the copies (the real one needs two GPUs:
tests/test_cuda_transport.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest
import torch
from pd.v1 import prefill_pb2

from decode_server.kv_receive import IpcHandoff
from engine.kv_cache import KVLayout, KVPool
from engine.transport.base import KVReceiver
from engine.transport.cuda_ipc import IpcKVReceiver, RemotePool

LAYERS = 10


class RecordingReceiver(KVReceiver):
    def __init__(self) -> None:
        self.copied = 0
        self.calls: list[str] = []  # the thread each copy ran on
        self.error = None

    def copy_layer(self, layer: int) -> None:
        assert layer == self.copied, "layers are copied once each, in order"
        self.calls.append(threading.current_thread().name)
        self.copied += 1

    def complete(self) -> bool:
        return self.copied == LAYERS


def handoff(writer: ThreadPoolExecutor) -> tuple[IpcHandoff, RecordingReceiver]:
    pool = KVPool(KVLayout("m", "float32", LAYERS, 1, 4, 4), 8, torch.device("cpu"))
    h = IpcHandoff(pool, [0, 1], 5, writer, remote=cast(RemotePool, None))  # the copies are the stand-in's
    receiver = RecordingReceiver()
    h.receiver = cast(IpcKVReceiver, receiver)
    return h, receiver


@pytest.mark.parametrize("reports", [list(range(LAYERS)), [0, 3, 4, 9], [9]])
def test_every_layer_up_to_the_last_report_is_copied_once(reports: list[int]) -> None:
    async def run() -> RecordingReceiver:
        with ThreadPoolExecutor(1, thread_name_prefix="kv-writer") as writer:
            h, receiver = handoff(writer)
            for layer in reports:
                await h.on_message(prefill_pb2.PrefillResponse(layer_sent=layer), time.monotonic() + 5)
            await h.wait_complete(time.monotonic() + 5)
            assert h.bytes == 5 * h.pool.layout.bytes_per_token
            return receiver

    receiver = asyncio.run(run())
    assert receiver.copied == LAYERS
    assert all(name.startswith("kv-writer") for name in receiver.calls)  # never on the event loop


def test_reports_that_arrive_while_the_writer_is_busy_share_one_call() -> None:
    async def run() -> tuple[RecordingReceiver, int]:
        with ThreadPoolExecutor(1, thread_name_prefix="kv-writer") as writer:
            h, receiver = handoff(writer)
            busy = threading.Event()
            writer.submit(busy.wait, 5)  # another handoff's call holds the writer
            submitted = 0
            original = writer.submit

            def counting_submit(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
                nonlocal submitted
                submitted += 1
                return original(*args, **kwargs)  # type: ignore[arg-type]

            writer.submit = counting_submit  # type: ignore[method-assign]
            for layer in range(LAYERS):
                await h.on_message(prefill_pb2.PrefillResponse(layer_sent=layer), time.monotonic() + 5)
            busy.set()
            await h.wait_complete(time.monotonic() + 5)
            return receiver, submitted

    receiver, submitted = asyncio.run(run())
    assert receiver.copied == LAYERS
    assert submitted == 1  # ten reports, one call


class FakeEvent:
    """A layer's CUDA event: `synchronize` waits for `gate`; `query` says whether it is done."""

    def __init__(self, done: bool = True, gate: threading.Event | None = None) -> None:
        self.done, self.gate = done, gate

    def synchronize(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(5)
        self.done = True

    def query(self) -> bool:
        return self.done


@pytest.mark.parametrize("unfinished", [None, 4])
def test_prefill_side_reports_cover_every_layer_already_written(unfinished: int | None) -> None:
    """The sender's thread reports the last layer written by the time it looks, never a layer
    before one it has reported, and always the last layer at the end."""
    from engine.transport.cuda_ipc import IpcKVSender

    reports: list[int] = []
    sender = IpcKVSender(reports.append)
    gate = threading.Event()
    # the thread waits on layer 0 while the rest queue up
    sender._events.put((0, cast(torch.cuda.Event, FakeEvent(gate=gate))))
    for layer in range(1, LAYERS):
        sender._events.put((layer, cast(torch.cuda.Event, FakeEvent(done=layer != unfinished))))
    gate.set()
    sender.finish()
    expected = [LAYERS - 1] if unfinished is None else [unfinished - 1, LAYERS - 1]
    assert reports == expected
