"""How long work handed to the event loop from another thread waits before the loop runs it: the
wait every token of the decode server has, from the engine thread to the stream that sends it.

A probe thread hands the loop a stamped callback every `interval_s`; the callback records how long
it waited. A timer on the loop itself would not do: uvloop's timers tick in whole milliseconds,
the size of what is measured. Samples are kept for `keep_s`, so a request can ask for the largest
wait while it was on the server (`max_between`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable


class LoopLagProbe:
    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float, keep_s: float = 120.0,
                 observe: Callable[[float], object] | None = None) -> None:
        self.loop, self.interval_s, self.keep_s, self.observe = loop, interval_s, keep_s, observe
        self.samples: deque[tuple[float, float]] = deque()  # (handed over, waited s), oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hand_over, daemon=True, name="loop-lag-probe")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _hand_over(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.loop.call_soon_threadsafe(self._record, time.perf_counter())
            except RuntimeError:  # the loop is closed
                return

    def _record(self, handed: float) -> None:
        now = time.perf_counter()
        self.samples.append((handed, now - handed))
        while self.samples and self.samples[0][0] < now - self.keep_s:
            self.samples.popleft()
        if self.observe is not None:
            self.observe(now - handed)

    def max_between(self, start: float, end: float) -> float:
        """The longest wait that overlapped [start, end] (perf_counter seconds); 0 without samples.
        The loop runs the callbacks in the order they were handed over, so the times they ran
        (handed + waited) only grow: the scan stops at the first that ran before `start`."""
        longest = 0.0
        for handed, waited in reversed(self.samples):
            if handed + waited < start:
                break
            if handed <= end:
                longest = max(longest, waited)
        return longest
