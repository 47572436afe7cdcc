"""The prefill side's hold on a request's KV blocks after its job ends, the same for every transport.

A decode server may still be reading the blocks when the job is over (cuda-ipc copies out of this
pool; over NCCL and gRPC it may still be checking what arrived), so they are neither freed nor reused
until it acknowledges (a `Release` call) or the lease runs out: the decode side has had the whole
transfer timeout by then, and a decode side that never answers is gone. An acknowledgement may come
before the job lets go of its blocks (the decode side gave up early); it is remembered, for a lease's
time, so the job's blocks are freed as soon as it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (decode peer id, request id)


class KVLeases:
    def __init__(self, free: Callable[[list[int]], None], lease_s: float, sweep_every_s: float = 1.0) -> None:
        self._free, self.lease_s = free, lease_s
        self._held: dict[Key, tuple[list[int], float]] = {}   # blocks, and when their lease runs out
        self._released: dict[Key, float] = {}                  # acknowledged before the job ended, until when
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_until_stopped, args=(sweep_every_s,), daemon=True,
                                         name="kv-leases")
        self._sweeper.start()

    @property
    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(blocks) for blocks, _ in self._held.values())

    def hold(self, peer_id: str, request_id: str, blocks: list[int]) -> None:
        """The job is over: keep its blocks until the decode side acknowledges (at once if it already has)."""
        key = (peer_id, request_id)
        with self._lock:
            acknowledged = self._released.pop(key, None) is not None
            if not acknowledged:
                self._held[key] = (blocks, time.monotonic() + self.lease_s)
        if acknowledged:
            self._free(blocks)

    def release(self, peer_id: str, request_id: str) -> None:
        """The decode side is done with the request's KV."""
        key = (peer_id, request_id)
        with self._lock:
            held = self._held.pop(key, None)
            if held is None:
                self._released[key] = time.monotonic() + self.lease_s
        if held is not None:
            self._free(held[0])

    def sweep(self) -> int:
        """Free the blocks whose lease ran out (and forget stale acknowledgements); returns how many leases."""
        now = time.monotonic()
        with self._lock:
            expired = [k for k, (_, until) in self._held.items() if until < now]
            blocks = [self._held.pop(k)[0] for k in expired]
            for k in [k for k, until in self._released.items() if until < now]:
                del self._released[k]
        for b in blocks:
            self._free(b)
        if expired:
            log.warning("freed the KV of %d requests whose decode side never acknowledged it", len(expired))
        return len(expired)

    def _sweep_until_stopped(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.sweep()

    def close(self) -> None:
        self._stop.set()
