"""Admission: a request is let in once every KV block it can need (prompt + max_new_tokens) is
reserved for it, first come first served; past the waiting limits it is refused at once. Its
prompt's cached leading blocks (the prefix cache) count among them: it needs fewer new ones, and its
prefill starts after them."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

import grpc

from decode_server.sequence import Rejected, RequestSequence
from engine.kv_cache import KVPool, OutOfBlocks
from engine.prefix_cache import PrefixCache


@dataclass
class _Waiter:
    seq: RequestSequence
    need: int
    admitted: asyncio.Future[None]


class Admission:
    """Reserves blocks on the event loop (`reserve`) and takes them back from any thread
    (`release`, which the scheduler calls when a sequence finishes), then hands them to the
    requests waiting, in arrival order, on the event loop."""

    def __init__(self, pool: KVPool, max_queued_requests: int, max_waiting_tokens: int,
                 loop: asyncio.AbstractEventLoop, cache: PrefixCache | None = None) -> None:
        """Without a `cache`, blocks come straight from the pool (a cache that keeps nothing)."""
        self.pool, self.loop = pool, loop
        self.cache = cache or PrefixCache(pool.allocator, pool.layout.block_size, enabled=False)
        self.max_queued_requests, self.max_waiting_tokens = max_queued_requests, max_waiting_tokens
        self._waiters: deque[_Waiter] = deque()
        self.waiting_tokens = 0  # the waiters' prompt + output tokens
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def reserve(self, seq: RequestSequence) -> None:
        """Put every block the request can need in `seq.block_table` (and the tokens its cached blocks
        hold in `seq.prefilled`), waiting behind earlier requests for as long as it takes; raises
        Rejected (RESOURCE_EXHAUSTED) past the limits."""
        need = self.pool.blocks_needed(seq.total_tokens)
        total = self.cache.num_blocks
        if need > total:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"the request needs {need} KV blocks, the whole pool has {total}")
        if not self._waiters and self._take(seq, need):
            return
        if self.waiting >= self.max_queued_requests:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full ({self.cache.num_available} of {total} blocks free, "
                           f"this request needs {need}) and {self.waiting} requests already wait "
                           f"(--max-queued-requests {self.max_queued_requests})")
        if self.waiting_tokens + seq.total_tokens > self.max_waiting_tokens:
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"KV pool is full and waiting requests hold {self.waiting_tokens} tokens; this one's "
                           f"{seq.total_tokens} would pass --max-waiting-tokens {self.max_waiting_tokens}")
        waiter = _Waiter(seq, need, self.loop.create_future())
        self._waiters.append(waiter)
        self.waiting_tokens += seq.total_tokens
        try:
            await waiter.admitted  # the blocks are in seq.block_table once this resolves
        finally:
            self.waiting_tokens -= seq.total_tokens
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._admit_waiters()  # this one may have been the head of the queue

    def _take(self, seq: RequestSequence, need: int) -> bool:
        """The sequence's blocks, cached prefix first, if the pool has them now (a waiter holds none)."""
        try:
            # a prompt's own log probabilities need every token's logits: none may come from the cache
            seq.block_table, seq.prefilled = self.cache.acquire(seq.prompt if seq.prompt_logprobs is None else (),
                                                                need, seq.cache_salt)
        except OutOfBlocks:
            return False
        seq.timing.cached_tokens = seq.prefilled
        return True

    def release(self, seq: RequestSequence) -> None:
        """Any thread: the sequence's blocks go back (once: its table is emptied) to the cache, or
        to the pool, and the requests waiting get them on the event loop."""
        with self._lock:
            blocks, seq.block_table = seq.block_table, []
        if blocks:
            self.cache.release(blocks)
            self.loop.call_soon_threadsafe(self._admit_waiters)

    def _admit_waiters(self) -> None:
        """On the event loop: hand free blocks to the waiting requests in arrival order."""
        while self._waiters:
            head = self._waiters[0]
            if head.admitted.done():
                self._waiters.popleft()
                continue
            if not self._take(head.seq, head.need):
                return
            head.admitted.set_result(None)
            self._waiters.popleft()
