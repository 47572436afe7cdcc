"""Later turns: `bench.engine --later-turns` on the CPU's tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import engine
from bench.later_turns import LaterTurns
from engine.offline import make_runner


def test_bench_engine_times_later_turns_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "later.json"
    monkeypatch.setattr(sys, "argv", ["bench/engine.py", "--later-turns", "--preset", "tiny", "--device", "cpu",
                                      "--prefix-lens", "32", "64", "--new-lens", "16", "40",
                                      "--later-turn-batches", "0", "2", "--context", "24", "--repeats", "1",
                                      "--json", str(out)])
    engine.main()
    doc = json.loads(out.read_text())
    assert doc["preset"] == "tiny" and doc["device"] == "cpu" and doc["command"].startswith("python -m bench.engine")
    rows = doc["later_turns"]
    assert [(r["batch"], r["prefix"], r["new"]) for r in rows] == [
        (b, p, n) for b in (0, 2) for p in (32, 64) for n in (16, 40)]
    for row in rows:
        assert row["ms"] > 0 and row["min_ms"] <= row["ms"] and row["repeats"] == 1
        if row["batch"]:
            assert row["context"] == 24 and row["gap_ms"] > 0 and row["step_ms"] > 0


def test_a_later_turn_finds_its_prefix_in_the_cache() -> None:
    runner = make_runner(preset="tiny")
    turns = LaterTurns(runner)
    turns.first_turn(48)
    free = runner.pool.allocator.num_free
    ms, gap = turns.turn_ms(48, 5)  # raises unless the cache gave all 48 tokens
    assert ms > 0 and gap is None
    assert runner.pool.allocator.num_free == free  # the turn's own block went back; the prefix stays cached
    with pytest.raises(ValueError, match="whole blocks"):
        turns.first_turn(20)
