"""Automatic prefix caching: full KV blocks of finished prefills stay in the pool, keyed by the hash
chain of their tokens, so a later prompt that starts the same way reuses them instead of recomputing.

Who owns what:
- A sequence's block table is its cached leading blocks followed by private blocks (`acquire` takes
  both at once, a reference on each cached one). It writes only its private blocks: a cached block is full, and every
  token in it was written before it was published, so a shared block is never written.
- `publish` turns a sequence's full, written blocks into cache entries (the sequence keeps its
  reference); a block equal to one already cached stays private.
- `release` drops the sequence's references: a cached block nobody references joins the LRU list (its
  KV stays for the next hit), a private block goes back to the allocator.
- `allocate` evicts least recently used unreferenced blocks when the allocator runs short, so
  `num_available` (free + evictable) is what a request can get: the cache never fails a request that
  would fit without it.

A hit is confirmed by the tokens, not the hash alone: each entry keeps its block's tokens and the entry
it followed when published, and a lookup accepts an entry only when both match the prompt. A hash
collision can miss, never serve another prompt's KV.

A request's `cache_salt` is its cache namespace: it seeds the hash chain (a first block's parent key), and
each entry keeps the seed it was published under, so prompts with different salts never share a block.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.kv_cache import BlockAllocator, OutOfBlocks

Tokens = Sequence[int] | np.ndarray


def token_blocks(tokens: Tokens, block_size: int, count: int) -> list[bytes]:
    """The first `count` full blocks of `tokens`, each as its ids' little-endian int32 bytes (the form
    blocks are keyed and compared in): one numpy conversion and one split for the whole prompt, not
    a slice and a copy per block (bench/NOTES.md: a 32k prompt's blocks held the event loop for ms)."""
    ids = np.asarray(tokens, dtype="<i4")[:max(count, 0) * block_size]
    return np.ascontiguousarray(ids).view(f"V{4 * block_size}").tolist()  # type: ignore[no-any-return]


def salt_seed(salt: str) -> bytes:
    """The hash chain's seed for a cache namespace: b"" without a salt, else the salt's hash."""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cache_salt").digest() if salt else b""


Key = int | bytes  # a block's key, or the salt's seed in a first block's place


def block_key(parent: Key, block: bytes) -> int:
    """A full block's key: the hash of its parent's key (the salt's seed for a first block) and its
    tokens' bytes. Python's own hash (SipHash, keyed afresh in each process): a key never leaves the
    process, and hits are confirmed by the tokens, so a collision can only miss. One C call a block,
    where BLAKE2b took three and a fresh object."""
    return hash((parent, block))


@dataclass(eq=False, slots=True)
class _Entry:
    block: int
    key: Key
    tokens: bytes
    parent: _Entry | None  # the entry this block followed when it was published; None for a first block
    seed: bytes            # salt_seed of the request that published it
    refs: int = 0


@dataclass(frozen=True)
class CacheStats:
    cached_blocks: int      # blocks holding a cached prefix, referenced or not
    used_blocks: int        # of those, blocks some sequence references
    queried_tokens: int     # prompt tokens looked up so far
    hit_tokens: int         # of those, tokens whose KV was found


class PrefixCache:
    """The pool's cached prefixes over its block allocator. Thread-safe (engine thread and event loop).

    With `enabled` False it only allocates and frees: nothing is found, published or kept.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator, self.block_size, self.enabled = allocator, block_size, enabled
        self._by_key: dict[Key, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # unreferenced entries, oldest first
        self._queried = self._hits = 0
        self._lock = threading.Lock()

    # --- sizes ----------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_available(self) -> int:
        """Blocks a request can have now: free ones, and cached ones nobody references."""
        with self._lock:
            return self.allocator.num_free + len(self._lru)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._by_block), len(self._by_block) - len(self._lru), self._queried, self._hits)

    # --- a sequence's blocks --------------------------------------------------------------------
    def cached_prefix_len(self, tokens: Tokens, salt: str = "") -> int:
        """How many leading tokens of this prompt `acquire` would find now (no reference, not counted)."""
        with self._lock:
            return len(self._match(tokens, salt_seed(salt))) * self.block_size

    def acquire(self, tokens: Tokens, num_blocks: int, salt: str = "") -> tuple[list[int], int]:
        """A block table of `num_blocks` for a sequence that starts with `tokens`: its cached leading
        blocks (each now referenced for the caller, who gives them back with `release`), then
        private ones. Returns it with the number of tokens it already holds. The block holding the
        prompt's last token is never a hit: that token is always computed, for its logits. Only blocks
        published under the same `salt` are found.

        All or nothing: raises OutOfBlocks, taking nothing, when the pool can't provide the rest."""
        with self._lock:
            entries = self._match(tokens, salt_seed(salt))[:num_blocks]
            need = num_blocks - len(entries)
            evictable = len(self._lru) - sum(1 for e in entries if e.refs == 0)
            if need > self.allocator.num_free + evictable:
                raise OutOfBlocks(f"need {need} KV blocks, {self.allocator.num_free + evictable} of "
                                  f"{self.allocator.num_blocks} can be had")
            for entry in entries:
                if entry.refs == 0:
                    del self._lru[entry.block]
                entry.refs += 1
            private = self._allocate(need)
            if self.enabled:
                self._queried += len(tokens)
                self._hits += len(entries) * self.block_size
        return [e.block for e in entries] + private, len(entries) * self.block_size

    def _match(self, tokens: Tokens, seed: bytes) -> list[_Entry]:
        if not self.enabled or not self._by_key:
            return []
        found: list[_Entry] = []
        parent: _Entry | None = None
        by_key = self._by_key
        # one key a block, up to the first miss; the block holding the last token is never a hit
        for block in token_blocks(tokens, self.block_size, (len(tokens) - 1) // self.block_size):
            entry = by_key.get(block_key(parent.key if parent else seed, block))
            if entry is None or entry.parent is not parent or entry.seed != seed or entry.tokens != block:
                break
            found.append(entry)
            parent = entry
        return found

    def allocate(self, n: int) -> list[int]:
        """`n` private blocks, evicting unreferenced cached blocks (least recently used first) when the
        allocator has too few free. Raises OutOfBlocks when even that is not enough."""
        with self._lock:
            return self._allocate(n)

    def _allocate(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if 0 < short <= len(self._lru):  # when eviction can't cover it, keep the cache: the allocator refuses
            self.allocator.free([self._evict_oldest() for _ in range(short)])
        return self.allocator.allocate(n)

    def _evict_oldest(self) -> int:
        block, entry = self._lru.popitem(last=False)
        del self._by_block[block]
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
        return block

    def publish(self, tokens: Tokens, block_table: Sequence[int], num_tokens: int, salt: str = "") -> None:
        """Cache the full blocks among the first `num_tokens` of this sequence (their KV is written, or
        enqueued on the stream every later reader uses). The caller keeps its reference to each.
        Blocks it published before are passed over unhashed: a finished sequence publishes again.
        `salt` must be the one its blocks were acquired under."""
        if not self.enabled:
            return
        seed = salt_seed(salt)
        blocks = token_blocks(tokens, self.block_size, num_tokens // self.block_size)
        with self._lock:
            parent: _Entry | None = None
            for block, block_tokens in zip(block_table[:len(blocks)], blocks, strict=True):
                entry = self._by_block.get(block)
                if entry is None or entry.parent is not parent:
                    key = block_key(parent.key if parent else seed, block_tokens)
                    existing = self._by_key.get(key)
                    if existing is not None:
                        if existing.parent is not parent or existing.seed != seed or existing.tokens != block_tokens:
                            return  # a hash collision: this chain stays uncached from here on
                        entry = existing  # the same block is cached already; ours stays private
                    else:
                        entry = _Entry(block, key, block_tokens, parent, seed, refs=1)
                        self._by_key[key] = self._by_block[block] = entry
                parent = entry

    def release(self, block_table: Sequence[int]) -> None:
        """Drop a sequence's blocks: references to cached ones (unreferenced ones become evictable,
        its last blocks first, so a prefix outlives its tails), private ones back to the allocator."""
        private: list[int] = []
        with self._lock:
            for block in reversed(block_table):
                entry = self._by_block.get(block)
                if entry is None:
                    private.append(block)
                    continue
                entry.refs -= 1
                if entry.refs == 0:
                    self._lru[block] = entry
            self.allocator.free(private)
