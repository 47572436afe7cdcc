"""The NCCL transport's pairing protocol, run over Gloo on CPU pools: a pair made through the prefill
side's PairingHost, its rendezvous relayed (no store port) for the holder of the pairing's secret only;
layer-by-layer sends matched by receives in transfer order, the out-of-step and aborted cases. (The same
classes run NCCL between GPUs; tests/test_cuda_transport.py covers that.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from pd.v1 import prefill_pb2

from engine.kv_cache import KVLayout, KVPool
from engine.transport.base import TransferCancelled
from engine.transport.nccl import DECODE_RANK, NcclKVReceiver, NcclKVSender, NcclPair, TransferFailed
from engine.transport.nccl_rendezvous import PairingHost, RelayStore, apply

LAYOUT = KVLayout("m", "float32", 3, 2, 8, 4)
CPU = torch.device("cpu")


def in_threads(*calls: Callable[[], object]) -> list[object]:
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def paired_through_the_host(timeout_s: float = 5.0) -> tuple[NcclPair, NcclPair]:
    """The prefill side's PairingHost opens a pairing; the decode side's store is a RelayStore, every
    operation of it a Rendezvous request the host runs (here called directly, not over gRPC)."""
    host = PairingHost(CPU, timeout_s)
    opened = host.open("decode-1")
    relay = RelayStore(lambda request, timeout: host.rendezvous(request), "decode-1", opened.secret, timeout_s)
    decode = NcclPair(relay, opened.name, DECODE_RANK, CPU, timeout_s)
    decode.warm_up()
    prefill = host.pair("decode-1")
    assert isinstance(prefill, NcclPair) and prefill.group == decode.group
    return prefill, decode


@pytest.fixture()
def pairs() -> Iterator[tuple[NcclPair, NcclPair]]:
    prefill, decode = paired_through_the_host()
    yield prefill, decode
    prefill.abort()
    decode.abort()


def test_rendezvous_needs_the_pairings_secret() -> None:
    """Another caller (wrong secret, unknown peer, or a secret from an earlier handshake) reaches no store."""
    host = PairingHost(CPU, 1.0)
    first = host.open("decode-1").secret
    second = host.open("decode-1").secret  # a new handshake replaces the pairing
    assert first != second and len(second) >= 32
    count = prefill_pb2.RendezvousRequest.OP_NUM_KEYS
    for peer, secret in (("decode-1", b"guess"), ("decode-1", first), ("decode-2", second)):
        with pytest.raises(PermissionError, match="handshake first"):
            host.rendezvous(prefill_pb2.RendezvousRequest(peer_id=peer, secret=secret, op=count))
    assert host.rendezvous(prefill_pb2.RendezvousRequest(peer_id="decode-1", secret=second, op=count)).number >= 0


def test_relayed_store_operations_behave_like_the_store() -> None:
    """Each operation of the relay, on both ends (a get waits for its key, within its deadline)."""
    backing = dist.HashStore()
    relay = RelayStore(lambda request, timeout: apply(backing, request), "p", b"s", 0.3)
    relay.set("k", b"v")
    assert relay.get("k") == b"v" and backing.get("k") == b"v"
    assert relay.add("n", 2) == 2 and relay.add("n", 3) == 5
    assert relay.check(["k", "n"]) and not relay.check(["k", "absent"])
    assert relay.compare_set("k", b"v", b"w") == b"w" and backing.get("k") == b"w"
    assert relay.num_keys() == backing.num_keys() and relay.delete_key("k") and not relay.check(["k"])
    relay.wait(["n"])
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        relay.get("never")
    assert time.monotonic() - started < 2
    with pytest.raises(ValueError, match="one key"):
        apply(backing, prefill_pb2.RendezvousRequest(op=prefill_pb2.RendezvousRequest.OP_GET, keys=["a", "b"]))


def filled_pool(tokens: int, seed: int, scattered: bool = False) -> tuple[KVPool, list[int]]:
    pool = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    table = pool.allocator.allocate(pool.blocks_needed(tokens))
    table = table[::-1] if scattered else table
    gen = torch.Generator().manual_seed(seed)
    for layer in range(LAYOUT.num_layers):
        kv = torch.randn(2, tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=gen)
        pool.write(layer, pool.slots(table, 0, tokens), kv)
    return pool, table


def transfer(prefill: NcclPair, decode: NcclPair, src: KVPool, src_table: list[int], dst: KVPool,
             dst_table: list[int], tokens: int) -> NcclKVReceiver:
    sender = NcclKVSender(prefill, src, src.slots(src_table, 0, tokens), deadline_s=5.0,
                          first=src.table_start(src_table, tokens))
    receiver = NcclKVReceiver(decode, dst, dst_table, tokens)

    def send() -> None:
        for layer in range(LAYOUT.num_layers):
            sender.layer_done(layer)
        sender.finish()

    in_threads(lambda: receiver.post(sender.sequence, time.monotonic() + 5), send)
    assert receiver.stopped.wait(5) and receiver.error is None  # the scatter thread placed every layer
    return receiver


def same_kv(a: KVPool, a_table: list[int], b: KVPool, b_table: list[int], tokens: int) -> bool:
    return all(torch.equal(a.read(layer, a.slots(a_table, 0, tokens)), b.read(layer, b.slots(b_table, 0, tokens)))
               for layer in range(LAYOUT.num_layers))


@pytest.mark.parametrize("src_scattered,dst_scattered", [(False, False), (True, False), (False, True), (True, True)])
def test_transfers_arrive_whole_and_in_order(pairs: tuple[NcclPair, NcclPair], src_scattered: bool,
                                             dst_scattered: bool) -> None:
    """Each side's blocks one run or scattered: the same bytes arrive either way."""
    prefill, decode = pairs
    dst = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    for seed, tokens in ((1, 21), (2, 5)):  # two transfers: the second is sequence 1 on both sides
        src, src_table = filled_pool(tokens, seed, src_scattered)
        dst_table = dst.allocator.allocate(dst.blocks_needed(tokens))
        dst_table = dst_table[::-1] if dst_scattered else dst_table
        # each side packs or places a layer by plain slices where its blocks are one run
        assert (src.table_start(src_table, tokens) is None) == (src_scattered and tokens > LAYOUT.block_size)
        receiver = transfer(prefill, decode, src, src_table, dst, dst_table, tokens)
        assert (receiver.first is None) == (dst_scattered and tokens > LAYOUT.block_size)
        assert receiver.complete() and same_kv(src, src_table, dst, dst_table, tokens)
    assert prefill.next_sequence == decode.next_sequence == 2


def test_out_of_step_receive_fails_within_its_deadline(pairs: tuple[NcclPair, NcclPair]) -> None:
    _, decode = pairs
    dst = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    receiver = NcclKVReceiver(decode, dst, dst.allocator.allocate(2), 5)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match="did not finish in time"):
        receiver.post(3, time.monotonic() + 0.3)  # transfers 0-2 never came
    assert time.monotonic() - started < 2 and not receiver.posted


def test_transfer_that_stops_mid_way_fails_within_its_deadline(pairs: tuple[NcclPair, NcclPair]) -> None:
    """The sender dies after the first layer: the receive side's scatter thread gives up at the
    deadline with the error the handoff reports, and never claims the KV is whole."""
    prefill, decode = pairs
    src, src_table = filled_pool(8, 4)
    dst = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    sender = NcclKVSender(prefill, src, src.slots(src_table, 0, 8), deadline_s=1.0)
    receiver = NcclKVReceiver(decode, dst, dst.allocator.allocate(dst.blocks_needed(8)), 8)
    started = time.monotonic()
    in_threads(lambda: receiver.post(sender.sequence, time.monotonic() + 0.5), lambda: sender.layer_done(0))
    assert receiver.posted and receiver.stopped.wait(5)
    assert isinstance(receiver.error, TransferFailed) and not receiver.complete()
    assert time.monotonic() - started < 3


def test_aborted_pair_refuses_new_sends_and_receives(pairs: tuple[NcclPair, NcclPair]) -> None:
    prefill, decode = pairs
    src, src_table = filled_pool(8, 3)
    sender = NcclKVSender(prefill, src, src.slots(src_table, 0, 8), deadline_s=1.0)
    prefill.abort()
    with pytest.raises(TransferCancelled):
        sender.layer_done(0)
    decode.abort()
    dst = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    with pytest.raises(TransferFailed, match="out of step"):
        NcclKVReceiver(decode, dst, dst.allocator.allocate(2), 8).post(0, time.monotonic() + 1)


def test_endpoint_benchmark_moves_every_byte() -> None:
    """bench.e2e.kv_transfer --mode endpoints for nccl (here its Gloo form on two CPU 'devices'): each
    repeat's pool arrives bit for bit, checked before the next repeat starts."""
    from bench.e2e import kv_endpoints_gpu

    rows = kv_endpoints_gpu.rows("nccl", "tiny", 300, 2, ("cpu", "cpu"))
    assert len(rows) == 2 and all(r["bitwise_equal"] and r["bytes"] == 300 * 512 for r in rows)


@pytest.mark.parametrize("dst_scattered", [False, True])
def test_failed_receive_frees_its_blocks_once_nothing_can_write_them(pairs: tuple[NcclPair, NcclPair],
                                                                   dst_scattered: bool) -> None:
    """The sender dies after the first layer. Received straight into the pool (one run of blocks),
    the handoff aborts the pair before the blocks may be reused, as NCCL could still write them;
    through a staging buffer it needs not."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from decode_server.kv_receive import NcclHandoff

    prefill, decode = pairs
    src, src_table = filled_pool(21, 5)
    dst = KVPool(LAYOUT, 64, CPU, reserved_blocks=1)
    dst_table = dst.allocator.allocate(dst.blocks_needed(21))
    dst_table = dst_table[::-1] if dst_scattered else dst_table
    sender = NcclKVSender(prefill, src, src.slots(src_table, 0, 21), deadline_s=1.0)
    receiver = NcclKVReceiver(decode, dst, dst_table, 21)
    assert receiver.into_pool == (not dst_scattered)
    in_threads(lambda: receiver.post(sender.sequence, time.monotonic() + 0.5), lambda: sender.layer_done(0))
    assert receiver.stopped.wait(5) and receiver.error is not None

    async def abandon() -> bool:
        with ThreadPoolExecutor(1) as writer:
            handoff = NcclHandoff(dst, dst_table, 21, writer, decode)
            handoff.receiver = receiver
            return await handoff.abandon(failed=False)

    assert asyncio.run(abandon())
    assert decode.broken == (not dst_scattered)
