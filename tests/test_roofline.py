"""bench.micro.roofline draws the recorded decode steps against the bandwidth roof (on the CPU, from the files)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.micro.roofline import plot, projection_points, step_points

ROOT = Path(__file__).resolve().parent.parent


def test_steps_and_projections_against_the_roof(tmp_path: Path) -> None:
    engine = {"hbm_gbps_measured": 4000.0, "preset": "p", "commit": "c", "decode_ms": {"1": 4.0, "64": 8.0},
              "decode_floor_ms": {"1": 3.0, "64": 4.0}}
    gemv = {"hbm_gbps_measured": 4000.0, "commit": "c",
            "rows": [{"shape": "down", "n": 1000, "k": 2000, "rows": 1, "gemv_us": 2.0, "cublas_us": 4.0},
                     {"shape": "down", "n": 1000, "k": 2000, "rows": 64, "gemv_us": None, "cublas_us": 5.0}]}
    steps = step_points(engine)
    assert [(p["batch"], round(p["share"], 3)) for p in steps] == [(1, 0.75), (64, 0.5)]
    assert round(steps[0]["gb"], 6) == 12.0  # the floor's bytes: 3 ms at 4,000 GB/s
    points = projection_points(gemv)
    got = [(p["rows"], p["kernel"], round(p["gbps"], 6)) for p in points]
    assert got == [(1, "gemv", 2000.0), (1, "cublas", 1000.0), (64, "cublas", 800.0)]
    plot(engine, gemv, str(tmp_path / "roof.png"))
    assert (tmp_path / "roof.png").read_bytes().startswith(b"\x89PNG")


def test_the_recorded_engine_results_plot() -> None:
    engine = json.loads((ROOT / "bench/results/engine-h200.json").read_text())
    assert all(0 < p["share"] <= 1 for p in step_points(engine))
