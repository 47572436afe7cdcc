"""Markdown cells and tables, as every renderer of bench/results into the documents writes them."""

from __future__ import annotations


def ms(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.{digits}f} ms"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
