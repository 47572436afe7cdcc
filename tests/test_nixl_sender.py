"""The prefill side's NIXL sender between two agents in one process (host-memory pools of the tiny
preset, UCX over TCP): it makes the next layers' WRITEs while it waits for their KV, posts each once its
layer is done, and notifies DONE; a pairing let go while a prefill runs posts none of the WRITEs made
ahead from its lists, and the decode side hears END. Each check runs in a process of its own: NIXL's
bundled libraries and grpc_tools' protoc, which other tests load, crash a process that holds both."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.transport.nixl import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs the nixl wheel")

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 40


@contextmanager
def two_agents() -> Iterator[tuple[Any, Any, Any, Any, list[int], list[int]]]:
    from bench.random_pool import make_pool
    from engine.transport.nixl import NixlAgent
    from engine.transport.nixl_descriptors import PoolAddress, chunk_tokens

    os.environ.setdefault("UCX_TLS", "tcp")
    send_pool, send_table = make_pool("tiny", TOKENS, seed=3)
    receive_pool, receive_table = make_pool("tiny", TOKENS, seed=None)
    send, receive = NixlAgent(send_pool, "test-prefill"), NixlAgent(receive_pool, "test-decode")
    try:
        peer = send.add_peer(receive.metadata)
        receive.add_peer(send.metadata)
        block = send_pool.layout.block_size
        prepared = send.prepare(peer, PoolAddress.of(receive_pool), chunk_tokens(block, block))
        yield send, receive, peer, prepared, send_table, receive_table
    finally:
        send.close()
        receive.close()


def sender_for(agents: tuple[Any, ...], tag: str, made: list[int]) -> Any:
    from engine.transport.nixl import NixlKVSender, prepared_writes
    from engine.transport.nixl_descriptors import chunk_pairs

    send, _, peer, prepared, send_table, receive_table = agents
    block = send.pool.layout.block_size
    writes = prepared_writes(send, peer, prepared, chunk_pairs(send_table, block, receive_table, block, 0, TOKENS,
                                                                prepared.chunk))

    def make(layer: int) -> Any:
        made.append(layer)
        return writes(layer)

    return NixlKVSender(send, peer, make, tag, send.pool.layout.num_layers, timeout_s=10.0, prepared=prepared)


def note(receive: Any, peer_name: str, tag: str) -> bytes | None:
    limit = time.monotonic() + 10
    while (kind := receive.take_note(peer_name, tag.encode())) is None and time.monotonic() < limit:
        time.sleep(0.01)
    return kind


def in_own_process(check: str) -> None:
    """Run `check` (a function of this module) in a fresh interpreter; its failure fails the test."""
    done = subprocess.run([sys.executable, "-c", f"from tests.test_nixl_sender import {check}; {check}()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_writes_made_ahead_land_every_layer_and_notify_done() -> None:
    in_own_process("check_writes_made_ahead")


def test_writes_made_from_released_lists_are_never_posted() -> None:
    in_own_process("check_released_lists")


def check_writes_made_ahead() -> None:
    with two_agents() as agents:
        writes_made_ahead(agents)


def check_released_lists() -> None:
    with two_agents() as agents:
        released_lists(agents)


def writes_made_ahead(agents: tuple[Any, ...]) -> None:
    from engine.kv_checksum import layer_checksums
    from engine.transport.nixl import DONE

    send, receive, _, _, send_table, receive_table = agents
    made: list[int] = []
    sender = sender_for(agents, "whole", made)
    layers = send.pool.layout.num_layers
    limit = time.monotonic() + 10
    while len(made) < layers and time.monotonic() < limit:  # no layer done yet: every WRITE is made ahead
        time.sleep(0.01)
    assert made == list(range(layers))
    for layer in range(layers):
        sender.layer_done(layer)
    sender.finish()
    sender.release()
    assert made == list(range(layers))  # none made twice
    assert note(receive, send.name, "whole") == DONE
    assert layer_checksums(receive.pool, receive_table, TOKENS) == layer_checksums(send.pool, send_table, TOKENS)


def released_lists(agents: tuple[Any, ...]) -> None:
    from engine.transport.nixl import END, TransferError

    send, receive, _, prepared, _, _ = agents
    receive.pool.storage.zero_()
    made: list[int] = []
    sender = sender_for(agents, "dropped", made)
    limit = time.monotonic() + 10
    while not made and time.monotonic() < limit:
        time.sleep(0.01)
    send.release_prepared(prepared)  # the decode server re-paired while this prefill ran
    for layer in range(send.pool.layout.num_layers):
        sender.layer_done(layer)
    refused: list[TransferError] = []

    def finish() -> None:
        try:
            sender.finish()
        except TransferError as e:
            refused.append(e)
        finally:
            sender.release()

    finishing = threading.Thread(target=finish)
    finishing.start()
    finishing.join(timeout=20)
    assert not finishing.is_alive() and refused
    assert note(receive, send.name, "dropped") == END
    assert not receive.pool.storage.any()  # nothing landed
