"""The prefill side's NIXL pairings, with real agents over host memory (UCX): both pools' descriptor lists
are prepared once per pairing (a handshake again from the same agent keeps them, its transfers may be
in flight) and released when the pairing is replaced (the decode server restarted with a new agent) or
dropped, its agent unloaded then; a request's KV lands by index into those lists, byte for byte, with
different block sizes on the two sides, only in the request's blocks.

Run in a process of its own by tests/test_nixl_peers.py: importing the prefill server's metrics beside
the decode server's, as the rest of the suite does, registers the same metric names twice; and NIXL's
libraries must not meet grpc_tools' in one process (engine.transport.nixl.nixl_available)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from pd.v1 import prefill_pb2

from engine.kv_cache import KVLayout, KVPool
from engine.presets import PRESETS
from engine.runner import ModelRunner
from engine.transport.handshake import layout_to_proto
from engine.transport.nixl import DONE, NixlAgent, TransferError
from engine.transport.nixl_descriptors import PoolAddress
from prefill_server.transports import NixlSenders
from prefill_server.worker import PrefillJob

PREFILL_BLOCK, DECODE_BLOCK = 16, 32


def pool(block_size: int, blocks: int, seed: int | None = None) -> KVPool:
    p = KVPool(KVLayout.for_model(PRESETS["tiny"], torch.float32, block_size), blocks, torch.device("cpu"))
    if seed is not None:
        p.storage.copy_(torch.randn(p.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return p


class PrepCounter:
    """Counts the prefill agent's calls to NIXL's prep_xfer_dlist, each still made by the real agent."""

    def __init__(self, agent: NixlAgent) -> None:
        self.calls = 0
        real = agent._agent.prep_xfer_dlist

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        agent._agent.prep_xfer_dlist = counted


@pytest.fixture
def prefill() -> Iterator[tuple[NixlSenders, PrepCounter]]:
    p = pool(PREFILL_BLOCK, 40, seed=1)
    senders = NixlSenders(cast(ModelRunner, SimpleNamespace(pool=p, layout=p.layout)), timeout_s=20)
    yield senders, PrepCounter(senders.agent)
    senders.agent.close()


@pytest.fixture
def decodes() -> Iterator[list[NixlAgent]]:
    agents = [NixlAgent(pool(DECODE_BLOCK, 24), f"decode-{i}") for i in range(3)]
    yield agents
    for agent in agents:
        agent.close()


def offer(agent: NixlAgent) -> prefill_pb2.HandshakeRequest:
    where = PoolAddress.of(agent.pool)
    return prefill_pb2.HandshakeRequest(layout=layout_to_proto(agent.pool.layout), nixl_metadata=agent.metadata,
                                        nixl_pool_addr=where.addr, nixl_pool_num_slots=where.num_slots,
                                        nixl_pool_device=where.device)


def loaded(senders: NixlSenders, decode: NixlAgent) -> bool:
    return bool(senders.agent._agent.check_remote_metadata(decode.name))


def test_replaced_pairing_releases_its_lists_and_unloads_the_old_agent(prefill, decodes) -> None:  # type: ignore[no-untyped-def]
    senders, counter = prefill
    a, b, c = decodes
    senders.pair("decode-1", offer(a))
    senders.pair("decode-2", offer(b))
    assert counter.calls == 4  # each pairing: our pool's list and the peer's
    first = senders._peers["decode-1"].prepared
    senders.pair("decode-1", offer(c))  # decode-1 restarted with a new agent
    assert counter.calls == 6
    assert first.released and first.local._released and first.remote._released
    assert not loaded(senders, a) and loaded(senders, b) and loaded(senders, c)
    assert senders._peers["decode-1"].agent == c.name and not senders._peers["decode-1"].prepared.released
    assert not senders._peers["decode-2"].prepared.released


def test_handshake_again_from_the_same_agent_keeps_its_lists(prefill, decodes) -> None:  # type: ignore[no-untyped-def]
    """...and they still serve: the agent's metadata loaded again leaves the prepared remote list valid."""
    senders, counter = prefill
    decode = decodes[0]
    senders.pair("decode-1", offer(decode))
    lists = senders._peers["decode-1"].prepared
    senders.pair("decode-1", offer(decode))  # after a freeze: the same process, transfers maybe in flight
    assert counter.calls == 2 and senders._peers["decode-1"].prepared is lists and not lists.released
    assert loaded(senders, decode)
    decode.add_peer(senders.agent.metadata)
    src, dst = [4, 9, 1], [7, 3]
    send(senders, job("again", 40, src, dst, send_from=0))
    assert decode.take_note(senders.agent.name, b"again") == DONE
    assert torch.equal(token_kv(decode.pool, dst, 0, 40), token_kv(senders.runner.pool, src, 0, 40))


def test_dropped_pairing_releases_its_lists_and_unloads_its_agent(prefill, decodes) -> None:  # type: ignore[no-untyped-def]
    senders, _ = prefill
    senders.pair("decode-1", offer(decodes[0]))
    senders.pair("decode-2", offer(decodes[1]))
    lists = senders._peers["decode-1"].prepared
    senders.forget("decode-1")
    senders.forget("never-paired")
    assert lists.released and not loaded(senders, decodes[0]) and list(senders._peers) == ["decode-2"]


def job(tag: str, tokens: int, src: list[int], dst: list[int], send_from: int) -> PrefillJob:
    return PrefillJob(tag, list(range(tokens)), cast(Any, None), src, "nixl", 0, cast(Any, None), cast(Any, None),
                      peer_id="decode-1", send_from=send_from, dst_block_table=dst, dst_block_size=DECODE_BLOCK,
                      dst_tag=tag)


def send(senders: NixlSenders, j: PrefillJob) -> None:
    sender = senders.sender(j, torch.empty(0))
    for layer in range(senders.runner.layout.num_layers):
        sender.layer_done(layer)
    sender.finish()


def token_kv(p: KVPool, table: list[int], start: int, end: int) -> torch.Tensor:
    return p.storage[:, :, p.slots(table, start, end)]


def written_slots(p: KVPool) -> set[int]:
    return set(torch.nonzero(p.storage.flatten(3).ne(0).any(-1).any(0).any(0)).flatten().tolist())


def test_requests_land_by_index_in_their_own_blocks(prefill, decodes) -> None:  # type: ignore[no-untyped-def]
    """Scattered blocks on both sides, 16-token blocks here and 32 there, the decode side's first block
    cached (not sent): each token's KV lands in its slot, nothing outside the request's uncached blocks is
    written, and no request prepares a list again."""
    senders, counter = prefill
    decode = decodes[0]
    senders.pair("decode-1", offer(decode))
    decode.add_peer(senders.agent.metadata)
    src, dst = [30, 3, 17, 8, 25, 11, 1], [20, 5, 9, 2]  # 112 and 128 slots
    for tokens, tag in ((100, "first"), (77, "second")):
        decode.pool.storage.zero_()
        send(senders, job(tag, tokens, src, dst, send_from=DECODE_BLOCK))
        assert decode.take_note(senders.agent.name, tag.encode()) == DONE
        assert torch.equal(token_kv(decode.pool, dst, DECODE_BLOCK, tokens),
                           token_kv(senders.runner.pool, src, DECODE_BLOCK, tokens)), tag
        sent = set(decode.pool.slots(dst, DECODE_BLOCK, tokens).tolist())
        blocks = {s for b in dst[1:-(-tokens // DECODE_BLOCK)] for s in range(b * DECODE_BLOCK, (b + 1) * DECODE_BLOCK)}
        assert sent <= written_slots(decode.pool) <= blocks, tag
    assert counter.calls == 2


def test_a_sender_of_a_replaced_pairing_fails_and_ends_the_transfer(prefill, decodes) -> None:  # type: ignore[no-untyped-def]
    senders, _ = prefill
    a, b = decodes[:2]
    senders.pair("decode-1", offer(a))
    a.add_peer(senders.agent.metadata)
    sender = senders.sender(job("late", 64, [1, 2, 3, 4], [1, 2], send_from=0), torch.empty(0))
    senders.pair("decode-1", offer(b))  # the decode server restarted while the job ran
    try:  # the sender's thread, making WRITEs ahead of the KV, may have met the replaced pairing already
        sender.layer_done(0)
    except TransferError as e:
        assert "replaced or dropped" in str(e)
    with pytest.raises(TransferError, match="replaced or dropped"):
        sender.finish()
