"""`python -m bench.micro.roofline`: the decode step against HBM bandwidth, drawn from recorded results.

Left: each batch size's step, its bytes (every weight but the embedding, plus the batch's KV) over
its time, beside the measured copy bandwidth and the targets. Right: each projection alone
(`bench.micro.gemv`), its weight bytes over its time, through the skinny kernel (up to 16 rows) and
through cuBLAS, at each row count. A decode step is memory-bound at every batch size here, so
bandwidth is the roof.

  python -m bench.micro.roofline --engine bench/results/engine-h200.json --gemv bench/results/gemv-h200.json \\
      --plot bench/results/roofline-h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGETS_MS = {1: 3.9}             # batch -> step target (ms)
TARGETS_TOK_PER_S = {64: 12000}   # batch -> tokens/s target


def step_points(engine: dict[str, Any]) -> list[dict[str, float]]:
    """Per batch: bytes (floor x measured bandwidth), step ms, achieved GB/s and its share of the copy rate."""
    hbm = engine["hbm_gbps_measured"]
    points = []
    for batch, ms in sorted(engine["decode_ms"].items(), key=lambda kv: int(kv[0])):
        gb = engine["decode_floor_ms"][batch] * 1e-3 * hbm
        points.append({"batch": int(batch), "gb": gb, "ms": ms, "gbps": gb / (ms * 1e-3),
                       "share": gb / (ms * 1e-3) / hbm})
    return points


def projection_points(gemv: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in gemv["rows"]:
        gb = row["n"] * row["k"] * 2 / 1e9
        for kernel in ("gemv", "cublas"):
            us = row[f"{kernel}_us"]
            if us:
                out.append({"shape": row["shape"], "rows": row["rows"], "kernel": kernel, "us": us,
                            "gbps": gb / (us * 1e-6)})
    return out


def plot(engine: dict[str, Any], gemv: dict[str, Any] | None, path: str) -> None:
    from matplotlib.figure import Figure

    hbm = engine["hbm_gbps_measured"]
    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2)
    steps = step_points(engine)
    left.plot([p["batch"] for p in steps], [p["gbps"] for p in steps], "o-", label="decode step (measured)")
    for p in steps:
        left.annotate(f"{p['ms']:.2f} ms\n{p['share']:.0%}", (p["batch"], p["gbps"]), textcoords="offset points",
                      xytext=(4, -24), fontsize="small")
    left.axhline(hbm, color="k", linestyle="--", label=f"HBM copy {hbm:,.0f} GB/s")
    for batch, ms in TARGETS_MS.items():
        gb = next(p["gb"] for p in steps if p["batch"] == batch)
        left.plot([batch], [gb / (ms * 1e-3)], "r*", markersize=12, label=f"target: {ms} ms at batch {batch}")
    for batch, tps in TARGETS_TOK_PER_S.items():
        point = next((p for p in steps if p["batch"] == batch), None)
        if point:
            left.plot([batch], [point["gb"] / (batch / tps)], "m*", markersize=12,
                      label=f"target: {tps:,} tok/s at batch {batch}")
    left.set(xscale="log", xlabel="batch (sequences, 1,024-token contexts)", ylabel="bytes / step time (GB/s)",
             title=f"decode step, {engine['preset']} ({engine['commit']})", ylim=(0, hbm * 1.15))
    left.set_xticks([p["batch"] for p in steps], [str(p["batch"]) for p in steps])
    left.legend(fontsize="small", loc="lower right")
    if gemv:
        projections = projection_points(gemv)
        shapes = list(dict.fromkeys(p["shape"] for p in projections))
        for i, shape in enumerate(shapes):
            for kernel, marker in (("gemv", "o-"), ("cublas", "x--")):
                pts = [p for p in projections if p["shape"] == shape and p["kernel"] == kernel]
                if pts:
                    right.plot([p["rows"] for p in pts], [p["gbps"] for p in pts], marker, color=f"C{i}",
                               label=f"{shape} ({'skinny' if kernel == 'gemv' else 'cuBLAS'})")
        right.axhline(gemv["hbm_gbps_measured"], color="k", linestyle="--", label="HBM copy")
        right.set(xscale="log", xlabel="rows (batch)", ylabel="weight bytes / time (GB/s)",
                  title=f"each projection alone ({gemv['commit']})", ylim=(0, gemv["hbm_gbps_measured"] * 1.15))
        right.legend(fontsize="x-small", ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.roofline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="bench/results/engine-h200.json")
    p.add_argument("--gemv", default="bench/results/gemv-h200.json")
    p.add_argument("--plot", default="bench/results/roofline-h200.png")
    args = p.parse_args()
    engine = json.loads(Path(args.engine).read_text())
    gemv = json.loads(Path(args.gemv).read_text()) if Path(args.gemv).exists() else None
    for point in step_points(engine):
        print(f"batch {point['batch']:>3}: {point['gb']:.2f} GB in {point['ms']:.3f} ms = {point['gbps']:,.0f} GB/s "
              f"({point['share']:.0%} of the copy rate)")
    plot(engine, gemv, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
