"""The objects a server builds before it serves (its modules, the model, the kernels: about 375k
tracked objects with the tiny model on the CPU, more on a GPU) are kept out of the garbage
collector's full passes. A full pass walks every tracked object while holding the GIL, so every
thread of the process waits for its whole length, the event loop included: 250-280 ms on a 2-core CPU
with the tiny model. Long-lived objects made while serving (the prefix cache's entries: 2,048 for
a 32k-token prompt) bring the next full pass closer. Frozen, the start-up objects are never walked
again, and a full pass takes a few ms (bench/NOTES.md)."""

from __future__ import annotations

import gc
import logging
import time
from collections import deque

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Just before serving: collect what start-up left over, then freeze every object that survived.
    Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects frozen: the garbage collector's full passes skip them", frozen)
    return frozen


def unfreeze_startup_objects() -> None:
    """At exit: the frozen objects back under the collector, so the interpreter's last passes
    finalize them (native extensions report objects never finalized as leaks)."""
    gc.unfreeze()


class GcPauses:
    """The collector's passes while a server runs, whichever thread triggered them: every thread,
    the event loop included, waits for each. Kept for `keep_s`, so a request can ask for the longest
    pass while it was on the server (`max_between`), beside its loop lag (serving/loop_lag.py)."""

    def __init__(self, keep_s: float = 120.0) -> None:
        self.keep_s = keep_s
        self.passes: deque[tuple[float, float]] = deque()  # (began, seconds), oldest first
        self._began = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._on_pass)

    def stop(self) -> None:
        gc.callbacks.remove(self._on_pass)

    def _on_pass(self, phase: str, info: dict[str, int]) -> None:
        """Called by the collector itself, on the thread it runs on, holding the GIL."""
        now = time.perf_counter()
        if phase == "start":
            self._began = now
            return
        self.passes.append((self._began, now - self._began))
        while self.passes and self.passes[0][0] < now - self.keep_s:
            self.passes.popleft()

    def max_between(self, start: float, end: float) -> float:
        """The longest pass that overlapped [start, end] (perf_counter seconds); 0 without one."""
        passes = list(self.passes)  # a copy first: a pass may start, and append, during the scan
        return max((took for began, took in passes if began <= end and began + took >= start), default=0.0)
