"""The prefix cache over the block allocator: hits by hash chain confirmed by tokens, reference counts,
LRU eviction of unreferenced blocks, and a model of the pool that proves a shared block is never
written and a hit always holds the prompt's own tokens."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import prefix_cache
from engine.kv_cache import BlockAllocator, OutOfBlocks
from engine.prefix_cache import PrefixCache

BS = 4


def make_cache(num_blocks: int = 32, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(num_blocks, first=1), BS, enabled)


def prefill(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], int]:
    """What a server does for one prompt: acquire its blocks, (compute the rest), publish.
    Returns the block table and how many tokens came from the cache."""
    table, cached = cache.acquire(tokens, -(-len(tokens) // BS))
    cache.publish(tokens, table, len(tokens))
    return table, cached


def test_a_repeated_prefix_hits_and_the_last_token_is_always_computed() -> None:
    cache = make_cache()
    first = list(range(10))                               # blocks [0-3] [4-7] and a partial [8, 9]
    table, cached = prefill(cache, first)
    assert cached == 0
    again, cached = prefill(cache, first + [50, 51, 52])
    assert cached == 8 and again[:2] == table[:2]         # the two full blocks, shared
    assert again[2] != table[2]                           # the partial block was never cached
    exact, cached = prefill(cache, list(range(8)))        # two full blocks: the second holds the last token
    assert cached == 4 and exact[0] == table[0] and exact[1] != table[1]
    s = cache.stats()
    assert (s.queried_tokens, s.hit_tokens) == (10 + 13 + 8, 8 + 4)


def test_a_different_block_ends_the_hit() -> None:
    cache = make_cache()
    prefill(cache, list(range(16)))
    assert cache.cached_prefix_len(list(range(8)) + [99, 9, 10, 11] + list(range(12, 17))) == 8
    assert cache.cached_prefix_len([1] + list(range(1, 17))) == 0
    assert cache.stats().queried_tokens == 16             # a peek is not a query


def test_hits_are_confirmed_by_tokens_not_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that ignores the tokens (every block collides) or the chain (a block's hash is its
    own tokens'), a lookup still finds only the prompt's own prefix."""
    cache = make_cache()
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, block: b"x")
    prefill(cache, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert cache.cached_prefix_len([9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert cache.cached_prefix_len([1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4
    assert cache.acquire([9, 9, 9, 9, 9], 2)[1] == 0

    cache = make_cache()
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, block: hashlib.sha256(block).digest())
    prefill(cache, [1, 1, 1, 1, 2, 2, 2, 2, 0])            # [2, 2, 2, 2] cached after [1, 1, 1, 1]
    prefill(cache, [3, 3, 3, 3, 4, 4, 4, 4, 0])
    assert cache.cached_prefix_len([3, 3, 3, 3, 2, 2, 2, 2, 0]) == 4  # same tokens, other parent: no hit


def test_blocks_nobody_references_stay_cached_until_space_is_needed_then_go_tails_first() -> None:
    cache = make_cache(num_blocks=7)                      # 6 usable blocks
    prompt = list(range(13))                              # 3 full blocks + 1 partial
    table, _ = prefill(cache, prompt)
    assert cache.num_available == 2
    cache.release(table)
    assert cache.num_available == 6 and cache.allocator.num_free == 3
    assert cache.stats().cached_blocks == 3 and cache.stats().used_blocks == 0
    taken = cache.allocate(4)                             # 3 free + 1 evicted: the prompt's last full block
    assert cache.cached_prefix_len(prompt) == 8
    cache.release(taken)
    taken = cache.allocate(6)                             # everything: the cache gives way entirely
    assert cache.cached_prefix_len(prompt) == 0 and cache.stats().cached_blocks == 0
    cache.release(taken)
    assert cache.num_available == cache.allocator.num_free == 6


def test_referenced_blocks_are_never_evicted_and_a_refused_request_evicts_nothing() -> None:
    cache = make_cache(num_blocks=7)
    prompt = list(range(9))
    table, _ = prefill(cache, prompt)                     # 3 blocks held
    other, _ = prefill(cache, [7] * 9)                    # 3 more: the pool is full
    cache.release(other)
    with pytest.raises(OutOfBlocks):
        cache.allocate(4)                                 # only 3 can be had (2 cached + 1 partial)
    assert cache.cached_prefix_len([7] * 9) == 8          # the refusal evicted nothing
    assert cache.allocate(3) and cache.cached_prefix_len(prompt) == 8  # held blocks stay
    with pytest.raises(OutOfBlocks):
        cache.allocate(1)


def test_a_hit_takes_its_blocks_off_the_eviction_list() -> None:
    cache = make_cache(num_blocks=7)
    prompt = list(range(9))
    table, _ = prefill(cache, prompt)
    cache.release(table)
    hit, cached = cache.acquire(prompt, 2)                # referenced again after being unreferenced
    assert cached == 8 and hit == table[:2] and cache.num_available == 4
    rest = cache.allocate(4)
    assert not set(rest) & set(hit) and cache.cached_prefix_len(prompt) == 8


def test_acquire_is_all_or_nothing_and_counts_its_own_hits_once() -> None:
    cache = make_cache(num_blocks=7)
    prompt = list(range(9))
    table, _ = prefill(cache, prompt)
    cache.release(table)                                  # 2 cached blocks nobody uses, 4 free
    before = (cache.num_available, cache.stats())
    with pytest.raises(OutOfBlocks):
        cache.acquire(prompt, 7)                          # 2 hits + 5 more: one too many
    assert (cache.num_available, cache.stats()) == before and cache.cached_prefix_len(prompt) == 8
    whole, cached = cache.acquire(prompt, 6)              # 2 hits + the 4 free: exactly the pool
    assert cached == 8 and sorted(whole) == list(range(1, 7)) and cache.num_available == 0


def test_a_request_that_fits_without_the_cache_fits_with_it() -> None:
    """Fill every block with cached prefixes, then ask for the whole pool."""
    cache = make_cache(num_blocks=17)
    for salt in range(8):
        table, _ = prefill(cache, [salt] * 8)
        cache.release(table)
    assert cache.stats().cached_blocks == 16 and cache.allocator.num_free == 0
    table = cache.allocate(16)
    assert sorted(table) == list(range(1, 17))
    cache.release(table)


def test_a_block_computed_twice_is_cached_once() -> None:
    cache = make_cache()
    prompt = list(range(12))
    a, _ = cache.acquire(prompt, 3)                       # two prefills of the same prompt at once,
    b, _ = cache.acquire(prompt, 3)                       # neither finding the other's blocks
    cache.publish(prompt, a, 12)
    cache.publish(prompt, b, 12)                          # b's copies stay private
    assert cache.stats().cached_blocks == 3 and cache.stats().used_blocks == 3
    cache.release(b)
    assert cache.allocator.num_free == 31 - 3             # b's blocks went back
    cache.release(a)
    assert cache.num_available == 31 and cache.stats().used_blocks == 0
    assert cache.acquire(prompt + [1], 4)[0][:3] == a


def test_republishing_a_longer_sequence_extends_its_chain() -> None:
    """A finished sequence publishes its generated tokens' full blocks too (a chat's next turn)."""
    cache = make_cache()
    prompt = list(range(6))
    table = cache.allocate(3)
    cache.publish(prompt, table, 6)
    answer = prompt + [40, 41, 42, 43, 44]
    cache.publish(answer, table, 11)
    assert cache.stats().cached_blocks == 2
    cache.release(table)
    assert cache.cached_prefix_len(answer + [7, 7]) == 8


def test_disabled_cache_only_allocates_and_frees() -> None:
    cache = make_cache(enabled=False)
    table, cached = prefill(cache, list(range(16)))
    assert cached == 0 and prefill(cache, list(range(16)))[1] == 0
    cache.release(table)
    assert cache.stats() == prefix_cache.CacheStats(0, 0, 0, 0)
    assert cache.allocator.num_free == 31 - 4


def test_a_long_prompt_is_looked_up_in_milliseconds() -> None:
    cache = make_cache(num_blocks=9000)
    prompt = np.random.default_rng(0).integers(0, 150_000, 32768).tolist()
    prefill(cache, prompt)
    started = time.perf_counter()
    assert cache.acquire(prompt, 8192)[1] == 8191 * BS
    assert time.perf_counter() - started < 0.5           # a hash call a block, not a Python step a token


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "finish", "grab"]), st.lists(st.integers(0, 1), min_size=1,
                                                                                      max_size=14),
                          st.integers(0, 1000)), max_size=40))
def test_pool_model(ops: list[tuple[str, list[int], int]]) -> None:
    """Random prompts over a two-token vocabulary (so they share prefixes), against a model of the
    pool's contents: a hit holds exactly the prompt's tokens, nothing writes a cached block, no block
    is held twice, and once everyone lets go every block can be had again."""
    cache = make_cache(num_blocks=13)
    content = np.full((13, BS), -1)
    live: list[list[int]] = []
    for op, prompt, pick in ops:
        if op == "start":
            need = -(-len(prompt) // BS)
            try:
                table, cached = cache.acquire(prompt, need)
            except OutOfBlocks:
                assert cache.num_available < need
                continue
            for i, block in enumerate(table[:cached // BS]):
                assert content[block].tolist() == prompt[i * BS:(i + 1) * BS]
            assert not set(table[cached // BS:]) & {b for t in live for b in t}  # never handed out twice
            for pos in range(cached, len(prompt)):  # the prefill writes only its private blocks
                content[table[pos // BS], pos % BS] = prompt[pos]
            cache.publish(prompt, table, len(prompt))
            live.append(table)
        elif op == "finish" and live:
            cache.release(live.pop(pick % len(live)))
        elif op == "grab":                                # someone else takes blocks (eviction pressure)
            grabbed = cache.allocate(min(1 + pick % 4, cache.num_available))
            assert not set(grabbed) & {b for t in live for b in t}
            content[grabbed] = -2                         # and overwrites them: a stale hit would show
            live.append(grabbed)
        # every usable block is exactly one of: held by a live table, free, cached by nobody
        assert cache.num_available + len({b for t in live for b in t}) == 12
    for table in live:
        cache.release(table)
    assert cache.num_available == 12 and cache.stats().used_blocks == 0


def test_a_salt_is_a_namespace_of_its_own() -> None:
    """Prompts under different salts never share a block; under the same salt they do, as without one."""
    cache = make_cache()
    prompt = list(range(13))
    table, _ = cache.acquire(prompt, 4, salt="tenant-a")
    cache.publish(prompt, table, len(prompt), salt="tenant-a")
    assert cache.cached_prefix_len(prompt) == 0
    assert cache.cached_prefix_len(prompt, salt="tenant-b") == 0
    assert cache.cached_prefix_len(prompt, salt="tenant-a") == 12
    other, cached = cache.acquire(prompt, 4, salt="tenant-b")
    assert cached == 0 and not set(other) & set(table)
    cache.publish(prompt, other, len(prompt), salt="tenant-b")  # its own copies, cached under its own salt
    assert cache.cached_prefix_len(prompt, salt="tenant-b") == 12
    assert cache.acquire(prompt, 4, salt="tenant-a")[0][:3] == table[:3]


def test_salts_are_confirmed_when_hashes_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that ignores the parent (so also the salt's seed), another salt's block is still no hit."""
    cache = make_cache()
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, block: hashlib.sha256(block).digest())
    prompt = list(range(9))
    table, _ = cache.acquire(prompt, 3, salt="a")
    cache.publish(prompt, table, 9, salt="a")
    assert cache.cached_prefix_len(prompt, salt="b") == 0
    assert cache.cached_prefix_len(prompt) == 0
    assert cache.cached_prefix_len(prompt, salt="a") == 8
