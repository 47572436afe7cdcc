"""bench.e2e.auto_thresholds on the CPU pair: the measurement runs end to end and its crossovers are read right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.e2e.auto_thresholds import crossovers
from tests.servers import ROOT, free_port_run

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)


def rows(busy_local: list[float], busy_remote: list[float], stalls: list[float]) -> list[dict[str, Any]]:
    out = []
    for i, n in enumerate((64, 512, 2048)):
        out += [{"busy": False, "prompt_tokens": n, "mode": "colocated", "ttft_ms_p50": (10.0, 25.0, 90.0)[i]},
                {"busy": False, "prompt_tokens": n, "mode": "disaggregated", "ttft_ms_p50": 30.0},
                {"busy": True, "prompt_tokens": n, "mode": "colocated", "ttft_ms_p50": busy_local[i],
                 "stall_ms_p50": stalls[i]},
                {"busy": True, "prompt_tokens": n, "mode": "disaggregated", "ttft_ms_p50": busy_remote[i]}]
    return out


def test_crossovers_take_the_longest_prompt_local_still_wins() -> None:
    assert crossovers(rows([10, 20, 90], [40, 40, 40], [10, 30, 80]), stall_ms=50) == {
        "auto_idle_local_tokens": 512, "auto_local_tokens": 512}
    assert crossovers(rows([10, 20, 30], [40, 40, 40], [10, 60, 80]), stall_ms=50)["auto_local_tokens"] == 64
    assert crossovers(rows([50, 50, 50], [40, 40, 40], [1, 1, 1]), stall_ms=50)["auto_local_tokens"] is None
    # a gain inside the margin does not count, and a win past a loss does not extend the crossover
    assert crossovers(rows([10, 38, 30], [40, 40, 40], [1, 1, 1]), stall_ms=50, margin_ms=5)["auto_local_tokens"] == 64


def test_bench_placement_on_the_cpu_pair(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    done = subprocess.run([sys.executable, "-m", "bench.e2e.auto_thresholds", "--preset", "tiny",
                           "--devices", "cpu", "cpu",
                           "--kv-cache-gb", "0.05", "--lengths", "16", "200", "--reps", "1", "--background-users", "1",
                           "--background-output-len", "400", "--port", str(free_port_run(2)), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 * 2 * 2 and doc["commit"] and doc["hardware"]
    busy = [r for r in doc["rows"] if r["busy"]]
    assert all(r["background_users"] == 1 and r["ttft_ms_p50"] > 0 and r["stall_ms_p50"] > 0 for r in busy)
    assert set(doc["suggested"]) == {"auto_idle_local_tokens", "auto_local_tokens"}
