"""The KV pool's block allocator (runs of consecutive blocks, so prompts are usually one slice of
the pool) and the slice test the GPU transports rely on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockAllocator, KVLayout, KVPool, OutOfBlocks, slot_ids


def is_run(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def longest_free_run(free: set[int]) -> int:
    best = 0
    for b in free:
        if b - 1 not in free:
            n = 1
            while b + n in free:
                n += 1
            best = max(best, n)
    return best


def test_allocations_are_runs_and_freed_runs_merge() -> None:
    alloc = BlockAllocator(20, first=2)
    a, b, c = alloc.allocate(5), alloc.allocate(3), alloc.allocate(4)
    assert (a, b, c) == ([2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13])
    alloc.free(b)
    d = alloc.allocate(2)
    assert d == [7, 8]                             # the lowest run that fits
    assert alloc.allocate(4) == [14, 15, 16, 17]   # the gap left (block 9) is too short
    alloc.free(a)
    alloc.free(d[::-1])                            # any order
    assert alloc.allocate(8) == list(range(2, 10))  # a's run, 7-8 and 9 merged into one
    assert alloc.num_free == 2


def test_fragmented_pool_still_serves_from_the_lowest_runs() -> None:
    alloc = BlockAllocator(10)
    blocks = [alloc.allocate(1) for _ in range(10)]
    for b in blocks[::2]:
        alloc.free(b)                              # free 0, 2, 4, 6, 8: no two adjacent
    assert alloc.allocate(3) == [0, 2, 4]
    assert alloc.num_free == 2
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks, 2 of 10 free"):
        alloc.allocate(3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=60))
def test_allocator_never_hands_out_a_block_twice(ops: list[tuple[bool, int, int]]) -> None:
    """Against a plain set of free ids: every block is free or held exactly once, and a request
    gets one run whenever the free blocks hold a run that long."""
    alloc = BlockAllocator(40, first=1)
    free, held = set(range(1, 40)), []
    for do_alloc, n, pick in ops:
        if do_alloc:
            if n > len(free):
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(n)
                continue
            fits = longest_free_run(free) >= n
            blocks = alloc.allocate(n)
            assert len(blocks) == n and set(blocks) <= free and (is_run(blocks) or not fits)
            free -= set(blocks)
            held.append(blocks)
        elif held:
            blocks = held.pop(pick % len(held))
            alloc.free(blocks)
            free |= set(blocks)
        assert alloc.num_free == len(free)


def test_table_start_names_one_run_of_slots() -> None:
    pool = KVPool(KVLayout("m", "float32", 1, 1, 4, 4), 16, torch.device("cpu"))
    assert pool.table_start([3, 4, 5], 12) == 12
    assert pool.table_start([3, 4, 9], 8) == 12     # only the blocks the tokens fill count
    assert pool.table_start([3, 4, 9], 9) is None
    assert pool.table_start([3, 5], 5) is None
    assert pool.table_start([5, 4], 8) is None
    assert pool.table_start([3], 0) is None
    assert pool.table_start([3], 5) is None         # the table is too short
    assert pool.table_start([7, 3, 4], 12, start=5) == 13  # from token 5: the blocks after the first
    assert pool.table_start([7, 3, 9], 12, start=5) is None
    assert pool.table_start([7, 3, 4], 12, start=12) is None  # no tokens


def test_writing_several_layers_at_once_equals_one_at_a_time() -> None:
    """The NCCL receiver scatters every layer that has landed in one call."""
    layout = KVLayout("m", "float32", 5, 2, 4, 4)
    one, many = (KVPool(layout, 16, torch.device("cpu"), reserved_blocks=1) for _ in range(2))
    table = one.allocator.allocate(3)[::-1]
    slots = one.slots(table, 0, 10)
    assert one.table_start(table, 10) is None
    kv = torch.randn(5, 2, 10, 2, 4)
    for layer in range(5):
        one.write(layer, slots, kv[layer])
    many.write_layers(0, 2, slots, kv[0:2])
    many.write_layers(2, 5, slots, kv[2:5])
    assert torch.equal(one.storage, many.storage)
    assert torch.equal(many.read(3, slots), kv[3])


@given(st.integers(1, 16), st.integers(0, 300), st.data())
def test_slot_ids_are_each_tokens_block_and_offset(block_size: int, n: int, data: st.DataObject) -> None:
    table = data.draw(st.lists(st.integers(0, 999), min_size=-(-n // block_size), max_size=-(-n // block_size) + 3,
                               unique=True))
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    want = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    assert slot_ids(table, start, end, block_size).tolist() == want
    assert slot_ids(torch.tensor(table), start, end, block_size).tolist() == want


def test_slot_ids_refuse_a_table_too_short() -> None:
    """Checked on the host: a device-side index past the table would end the CUDA context."""
    with pytest.raises(IndexError, match="need 3 blocks; the table has 2"):
        slot_ids([1, 2], 0, 40, 16)
