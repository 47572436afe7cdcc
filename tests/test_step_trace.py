"""--step-trace's records, and how bench.e2e.partitioned_gaps tells a slow step's make-up from them."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.e2e.partitioned_gaps import classify
from decode_server.step_trace import StepTrace, read_trace


def step(k: int, tokens_s: float, gpu_ms: float, launch_ms: float = 0.1, requests: tuple[str, ...] = ("a",)) -> dict:
    launch = tokens_s - 0.004
    return {"kind": "step", "step": k, "batch": len(requests), "requests": list(requests), "launch_s": launch,
            "launched_s": launch + launch_ms / 1e3,
            "read_s": tokens_s - 0.001, "tokens_s": tokens_s, "gpu_ms": gpu_ms}


def test_trace_round_trip_on_the_cpu(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path / "t.jsonl")
    marks = trace.begin_step(["x", "y", "z"], 3, torch.device("cpu"))
    marks.queued()
    trace.step_read(marks, marks.launched_s, marks.launched_s + 0.001)
    trace.prefill("b", 4096, 72, 1.0, 1.1, 2.0)
    trace.close()
    trace.step_read(marks, 0.0, 0.0)  # after close: dropped, not raised
    steps, prefills = read_trace(tmp_path / "t.jsonl")
    assert [(s["batch"], s["requests"]) for s in steps] == [(3, ["x", "y", "z"])] and steps[0]["gpu_ms"] is None
    assert prefills == [{"kind": "partitioned_prefill", "request_id": "b", "tokens": 4096, "sms": 72,
                         "start_s": 1.0, "queued_s": 1.1, "end_s": 2.0}]


def test_slow_steps_are_told_apart() -> None:
    t = 100.0
    steps = []
    for k in range(20):  # alone: 4 ms steps
        t += 0.004
        steps.append(step(k, t, 3.9))
    start = t
    gaps = [(0.006, 5.9, 0.1), (0.012, 11.5, 0.1), (0.006, 5.8, 0.1), (0.010, 5.0, 3.0), (0.011, 5.5, 0.1)]
    for k, (gap, gpu, launch) in enumerate(gaps):
        t += gap
        steps.append(step(20 + k, t, gpu, launch))
    t += 1.0  # A is done; B's first step comes a second later: an idle engine, no one's gap
    steps.append(step(25, t, 4.0, requests=("b",)))
    prefills = [{"start_s": start + 1e-4, "queued_s": start + 0.02, "end_s": t}]
    report = classify(steps, prefills)
    assert report["median_step_alone_ms"] == 4.0 and report["steps_beside_prefills"] == 5
    kinds = [(s["gap_ms"], s["kind"], s["while_queueing"]) for s in report["slow_steps"]]
    assert kinds == [(12.0, "gpu", True), (10.0, "launch", False), (11.0, "host", False)]
    assert report["slow_by_kind"] == {"gpu": 1, "launch": 1, "host": 1}
