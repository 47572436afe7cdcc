"""`--step-trace PATH`: one JSON line per decode step and per partitioned prefill, to tell where a
slow gap between two tokens came from.

A decode step's line holds its host times (perf_counter seconds: when the engine thread began and
ended queueing it, began waiting for its tokens, and had them) and its GPU time (two CUDA events
around the step's kernels on the compute stream). A gap whose GPU time is long was the device's
(the prefill beside it took SMs, memory bandwidth or L2); a gap whose GPU time is short but whose
launch or read came late was the host's (the engine thread waited, e.g. for the GIL). A partitioned
prefill's line holds its start, the moment its last layer was queued, and its end, on the same clock.

`python -m bench.e2e.partitioned_gaps` reads the file. Tracing costs two events a step; off by default.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch


@dataclass
class StepMarks:
    """One decode step's marks, filled as it goes."""

    batch: int
    requests: list[str]  # the first rows' request ids: a gap counts between steps that share one
    launch_s: float
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    launched_s: float = 0.0

    def queued(self) -> None:
        """The step's kernels are queued: its end event follows them on the compute stream."""
        if self.end is not None:
            self.end.record()
        self.launched_s = time.perf_counter()


class StepTrace:
    def __init__(self, path: str | Path) -> None:
        # a line at a time, so it can be read while the server runs; closed by close()
        self._file: IO[str] = Path(path).open("w", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()  # the engine and partitioned-prefill threads both write
        self.steps = 0

    def begin_step(self, requests: list[str], batch: int, device: torch.device) -> StepMarks:
        timed = device.type == "cuda"
        marks = StepMarks(batch, requests, time.perf_counter(), *((torch.cuda.Event(enable_timing=True),
                                                          torch.cuda.Event(enable_timing=True)) if timed
                                                         else (None, None)))
        if marks.start is not None:
            marks.start.record()
        return marks


    def step_read(self, marks: StepMarks, read_s: float, tokens_s: float) -> None:
        """The step's tokens are on the host, so its end event has completed."""
        gpu_ms = marks.start.elapsed_time(marks.end) if marks.start is not None and marks.end is not None else None
        self.steps += 1
        self._write({"kind": "step", "step": self.steps, "batch": marks.batch, "requests": marks.requests,
                     "launch_s": marks.launch_s,
                     "launched_s": marks.launched_s, "read_s": read_s, "tokens_s": tokens_s, "gpu_ms": gpu_ms})

    def prefill(self, request_id: str, tokens: int, sms: int, started_s: float, queued_s: float,
                finished_s: float) -> None:
        self._write({"kind": "partitioned_prefill", "request_id": request_id, "tokens": tokens, "sms": sms,
                     "start_s": started_s, "queued_s": queued_s, "end_s": finished_s})

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:  # a step may end after the server closed its trace
                self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_trace(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A trace's decode steps and partitioned prefills, each in the order written."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return ([r for r in records if r["kind"] == "step"], [r for r in records if r["kind"] == "partitioned_prefill"])
