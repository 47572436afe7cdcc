"""`python -m bench.micro.gil_convoy`: how long a thread takes to make N short calls that each let go of
the GIL (as posting a transfer's NCCL receives does: one call per layer) while another thread of
the process keeps the CPU busy (an event loop streaming tokens), at several GIL switch intervals.

Each call gives the GIL up and then waits for the busy thread to be made to hand it back, which
Python does only every switch interval (5 ms by default): N calls cost about N switch intervals.
The servers' `--gil-switch-ms` sets the interval. Runs on any machine.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def _busy(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def _calls(n: int) -> float:
    x = torch.zeros(64)
    started = time.perf_counter()
    for _ in range(n):
        torch.add(x, 1, out=x)  # a torch op: lets go of the GIL while it runs
        time.sleep(0)           # a blocking call: lets go of it too
    return time.perf_counter() - started


def measure(calls: int, interval_ms: float, busy: bool) -> float:
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1e3)
    stop = threading.Event()
    hog = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if busy:
        hog.start()
    try:
        result: list[float] = []
        worker = threading.Thread(target=lambda: result.append(_calls(calls)))
        worker.start()
        worker.join()
        return result[0]
    finally:
        stop.set()
        if busy:
            hog.join()
        sys.setswitchinterval(before)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.gil_convoy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=28, help="calls in a row (default: one per Qwen2.5-7B layer)")
    p.add_argument("--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.5])
    args = p.parse_args()
    idle = measure(args.calls, 5.0, busy=False)
    print(f"{args.calls} calls, nothing else running: {idle * 1e3:.2f} ms")
    for ms in args.intervals_ms:
        took = measure(args.calls, ms, busy=True)
        print(f"{args.calls} calls beside a busy thread, switch interval {ms:g} ms: {took * 1e3:.1f} ms "
              f"({took / args.calls * 1e3:.2f} ms a call)")


if __name__ == "__main__":
    main()
