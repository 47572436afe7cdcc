"""`python -m bench.e2e.partitioned_splits`: from a scenario run with `partitioned:N` rows (bench.e2e.all_modes), the
trade-off they measured: a plot of A's median and worst gap against B's TTFT, every mode of one B
length beside each other, and (--table) the rows --itl-slo-ms picks a split from, with the run's
date, hardware, commit and command.

    python -m bench.e2e.partitioned_splits bench/results/scenario-h200.json --b-len 32768 \\
        --plot bench/results/partitioned-h200.png --table decode_server/sm_split_table.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.common import write_json
from client.scenario_report import Row, mode_label


def rows_of(doc: dict[str, Any], b_len: int) -> list[Row]:
    rows = [Row(**r) for r in doc["rows"] if r["b_len"] == b_len]
    if not rows:
        raise ValueError(f"the scenario has no rows at B = {b_len} tokens")
    return rows


def split_table(doc: dict[str, Any], rows: list[Row], source: str) -> dict[str, Any]:
    """decode_server/sm_split_table.json's form: A's worst gap per prefill SM count."""
    alone = next((r for r in rows if r.mode == "alone"), None)
    parts = sorted((r for r in rows if r.mode == "partitioned" and r.prefill_sms), key=lambda r: r.prefill_sms or 0)
    if alone is None or not parts:
        raise ValueError("the table needs an `alone` row and `partitioned:N` rows at that B length")
    b_len = rows[0].b_len
    return {
        "about": "A's longest gap between two tokens while a prompt's prefill runs beside its decode steps, per SM "
                 "count of the prefill's green context; --itl-slo-ms picks the largest count whose gap is within it. "
                 "Written by python -m bench.e2e.partitioned_splits from a scenario run (docs/partitioned.md).",
        "provenance": {"source": f"{source}: the scenario's partitioned rows at B = {b_len} tokens, a_gap_ms = "
                                 "A's worst gap, decode_step_alone_ms = A's median gap alone",
                       **{k: doc.get(k) for k in ("hardware", "torch", "date", "commit", "command")}},
        "decode_step_alone_ms": round(alone.a_median_gap_ms, 3),
        "rows": [{"prefill_sms": r.prefill_sms, "a_gap_ms": round(r.a_worst_gap_ms, 2),
                  "a_median_gap_ms": round(r.a_median_gap_ms, 3), "a_slow_gaps": r.a_slow_gaps,
                  "b_ttft_ms": None if r.b_ttft_ms is None else round(r.b_ttft_ms, 1)} for r in parts],
    }


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    alone = next((r for r in rows if r.mode == "alone"), None)
    if alone is not None:
        ax.axhline(alone.a_median_gap_ms, color="grey", lw=0.8, label="A's median gap alone")
        ax.axhline(2 * alone.a_median_gap_ms, color="grey", ls="--", lw=0.8, label="twice that (a slow gap)")
    for r in rows:
        if r.b_ttft_ms is None:
            continue
        (line,) = ax.plot([r.b_ttft_ms] * 2, [r.a_median_gap_ms, r.a_worst_gap_ms], lw=1)
        ax.plot([r.b_ttft_ms], [r.a_median_gap_ms], marker="o", color=line.get_color())
        ax.plot([r.b_ttft_ms], [r.a_worst_gap_ms], marker="^", color=line.get_color(), label=mode_label(r))
    ax.set_yscale("log")
    ax.set_xlabel("B's time to first token (ms)")
    ax.set_ylabel("A's gap between tokens (ms): o median, ^ worst")
    ax.set_title(f"One GPU, B = {rows[0].b_len:,} tokens: what B's prefill costs A, against B's TTFT")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.partitioned_splits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", help="a scenario result JSON (bench.e2e.all_modes / client.scenario --json)")
    p.add_argument("--b-len", type=int, default=32768, help="B's prompt length to read (default: %(default)s)")
    p.add_argument("--plot", help="PNG of A's median and worst gap against B's TTFT, one point pair per mode")
    p.add_argument("--table", help="write the SLO table here (the server reads decode_server/sm_split_table.json)")
    args = p.parse_args(argv)
    try:
        doc = json.loads(Path(args.scenario).read_text())
        rows = rows_of(doc, args.b_len)
        if args.table:
            write_json(args.table, split_table(doc, rows, args.scenario))
            print(f"wrote {args.table}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {args.scenario}: {e}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
