"""What the renderers of docs/results.md's and docs/partitioned.md's history tables share: a results
file, its runs through their `previous` chain, a run by its commit, the provenance line above a table,
and the cells' number formats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESULTS = Path("bench/results")  # as bench.readme_tables reads them, from the repository's root
Doc = dict[str, Any]
# the two-GPU load runs' deployments, as their tables name them
LOAD_2X_LABELS = {"partitioned": "partitioned, one decode server per GPU", "layered": "layered, one per GPU",
                  "colocated": "colocated, one per GPU", "split": "split pair: prefill GPU + decode GPU",
                  "auto": "`auto` on the split pair"}


def load(name: str) -> Doc:
    return json.loads((RESULTS / name).read_text())


def runs(doc: Doc) -> Iterator[Doc]:
    """A results file's runs, newest first: the file's own, then each `previous`."""
    while doc:
        yield doc
        doc = doc.get("previous") or {}


def run_at(file: str, commit: str) -> Doc:
    """The run of `file` (its own or one under `previous`) measured at `commit`."""
    found = [run for run in runs(load(file)) if run["commit"] == commit]
    if not found:
        raise KeyError(f"{file} holds no run at {commit}")
    return found[0]


def link(file: str) -> str:
    return f"[`{file}`](bench/results/{file})"


def about(run: Doc, file: str, where: str = "") -> str:
    """A run's provenance: hardware, date, commit, command, and the file (with `where` in it, if given)."""
    place = f"{link(file)}{' ' + where if where else ''}"
    return f"{run['hardware']}, {run['date'][:10]}, commit {run['commit']}, `{run['command']}`, {place}"


def caption(*parts: str) -> str:
    return "*" + "; ".join(parts) + ".*"


def sig(value: float) -> str:
    """Three significant figures below 100 (4.46, 29.9), whole numbers above."""
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def whole(value: float) -> str:
    """One decimal below 10 (6.6), whole numbers from 10 (27, 1,395)."""
    return f"{value:.1f}" if value < 10 else f"{value:,.0f}"


def gap(value: float) -> str:
    """A's worst gap: one decimal below 20 ms (5.2, 12.0), whole milliseconds above (40, 1,008)."""
    return f"{value:.1f}" if value < 20 else f"{value:,.0f}"


def span(values: list[float], digits: int = 1, unit: str = "", thousands: bool = False, widen: bool = True) -> str:
    """`low-high` at `digits` decimals, with more decimals where both ends would read alike (unless not
    `widen`: then one figure)."""
    low, high = min(values), max(values)
    comma = "," if thousands else ""

    def text(v: float, d: int) -> str:
        return f"{v:{comma}.{d}f}"
    while widen and low != high and text(low, digits) == text(high, digits) and digits < 3:
        digits += 1
    body = text(low, digits) if text(low, digits) == text(high, digits) else f"{text(low, digits)}-{text(high, digits)}"
    return body + unit
