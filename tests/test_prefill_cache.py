"""The prefill server's prefix cache, spoken to as a decode server would: a repeated prefix is not
recomputed, the KV and first token equal a cache-less server's, only the KV the decode side lacks is
sent, and a pool full of cached prefixes still serves any prompt that fits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from pd.v1 import prefill_pb2, prefill_pb2_grpc

from engine.kv_cache import KVLayout
from engine.presets import TINY
from engine.transport.handshake import layout_to_proto
from launcher.process import start_all, stop_all
from tests.test_reliability_fixtures import Server, wait_kv_idle

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

LAYOUT = KVLayout.for_model(TINY, torch.float32, 16)


@pytest.fixture(scope="module")
def servers(server_logs: Path) -> Iterator[tuple[Server, Server, Server]]:
    """(cached, uncached, small): the last with a pool of 18 blocks of 16 tokens and 256-token prompts."""
    cached = Server("prefill_server", [], server_logs)
    uncached = Server("prefill_server", ["--no-prefix-cache"], server_logs)
    small = Server("prefill_server", ["--kv-cache-gb", "0.0003", "--max-model-len", "256"], server_logs)
    start_all([cached, uncached, small])
    yield cached, uncached, small
    stop_all([cached, uncached, small])


class Peer:
    """A decode server's side of the Prefill service, over the gRPC transport: it releases each
    prefill's blocks once it has the KV, as a decode server does."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.stub.Handshake(prefill_pb2.HandshakeRequest(layout=layout_to_proto(LAYOUT), transports=["grpc"],
                                                         peer_id="test-peer"), timeout=10)

    def prefill(self, tokens: list[int], have: int = 0) -> tuple[prefill_pb2.PrefillDone, np.ndarray, set[int]]:
        """PrefillDone, the KV received as [layers, 2, tokens, heads, dim] (NaN where none came), and the
        token positions that came."""
        kv = np.full((LAYOUT.num_layers, 2, len(tokens), LAYOUT.num_kv_heads, LAYOUT.head_dim), np.nan, np.float32)
        sent: set[int] = set()
        done = None
        request = prefill_pb2.PrefillRequest(request_id=f"r{len(tokens)}-{have}", token_ids=tokens,
                                             transport="grpc", peer_id="test-peer", decode_cached_tokens=have)
        for reply in self.stub.Prefill(request, timeout=30):
            if reply.HasField("kv"):
                c = reply.kv
                part = np.frombuffer(c.data, np.float32).reshape(2, c.token_end - c.token_start,
                                                                 LAYOUT.num_kv_heads, LAYOUT.head_dim)
                kv[c.layer, :, c.token_start:c.token_end] = part
                sent |= set(range(c.token_start, c.token_end))
            elif reply.HasField("done"):
                done = reply.done
        assert done is not None
        self.stub.Release(prefill_pb2.ReleaseRequest(request_id=request.request_id, peer_id="test-peer"), timeout=10)
        return done, kv, sent


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def test_a_repeated_prefix_is_not_recomputed_and_changes_nothing(servers: tuple[Server, Server, Server]) -> None:
    cached, uncached, _ = servers
    with_cache, without = Peer(cached), Peer(uncached)
    turn1 = prompt(50, salt=1)
    turn2 = turn1 + prompt(30, salt=2)
    done, _, _ = with_cache.prefill(turn1)
    assert done.cached_tokens == 0
    done, kv, sent = with_cache.prefill(turn2)
    assert done.cached_tokens == 48                        # three full blocks of the first turn
    reference, ref_kv, _ = without.prefill(turn2)
    assert reference.cached_tokens == 0
    assert done.first_token_id == reference.first_token_id
    assert sent == set(range(80)) and done.kv_bytes == 80 * LAYOUT.bytes_per_token
    np.testing.assert_allclose(kv, ref_kv, rtol=1e-4, atol=1e-5)
    assert without.prefill(turn2)[0].cached_tokens == 0     # --no-prefix-cache keeps nothing
    m = cached.metrics()
    assert m["prefix_cache_hit_tokens_total"] == 48 and m["prefix_cache_queried_tokens_total"] == 130
    assert uncached.metrics()["prefix_cache_blocks"] == 0
    wait_kv_idle(cached, uncached)                         # cached blocks count as free: nobody uses them
    assert m["prefix_cache_blocks"] >= 3 and cached.metrics()["prefix_cache_used_blocks"] == 0


def test_only_the_kv_the_decode_side_lacks_is_sent(servers: tuple[Server, Server, Server]) -> None:
    cached, uncached, _ = servers
    tokens = prompt(70, salt=3)
    _, full, _ = Peer(uncached).prefill(tokens)
    peer = Peer(cached)
    for have in (32, 64, 69):                              # the decode side's prefix; the first also a hit here
        done, kv, sent = peer.prefill(tokens, have=have)
        assert sent == set(range(have, 70)) and done.kv_bytes == (70 - have) * LAYOUT.bytes_per_token
        np.testing.assert_allclose(kv[:, :, have:], full[:, :, have:], rtol=1e-4, atol=1e-5)
    for bad in (70, -1):
        with pytest.raises(grpc.RpcError) as e:
            peer.prefill(tokens, have=bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "decode_cached_tokens" in e.value.details()  # type: ignore[attr-defined]


def test_cached_prefixes_give_way_to_any_prompt_that_fits(servers: tuple[Server, Server, Server]) -> None:
    _, _, small = servers
    peer = Peer(small)
    total = small.metrics()["kv_cache_total_blocks"]
    assert total == 18
    for salt in range(4):                                  # 4 x 12 cached blocks: more than the pool holds
        peer.prefill(prompt(200, salt=10 + salt))
    assert small.metrics()["prefix_cache_blocks"] >= 12
    done, _, sent = peer.prefill(prompt(255, salt=20))     # needs 16 of the 18 blocks
    assert len(sent) == 255 and done.cached_tokens == 0
    assert peer.prefill(prompt(255, salt=20))[0].cached_tokens == 240
    wait_kv_idle(small)
