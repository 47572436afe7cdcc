"""`--plot`: every inter-token gap against its wall time, and TTFT against prompt length; one color per run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from client.load_run import RunResult


def _plain_log_labels(ax: Any) -> None:
    """Log axes labelled 2, 5, 10, 20, 50... rather than 2x10^1: latencies read at a glance."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _: object) -> str:
        return f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def plot_runs(results: Sequence[RunResult], path: str) -> None:
    # Figure without pyplot: the Agg canvas, no global figure state, no display needed
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8))
    itl_ax, ttft_ax = fig.subplots(1, 2)
    for i, result in enumerate(results):
        color, name = f"C{i}", result.deployment.name
        ok = [r for r in result.records if r.ok]
        times = [t for r in ok for t in r.token_times_s[1:]]
        gaps = [g * 1e3 for r in ok for g in r.gaps_s]
        itl_ax.scatter(times, gaps, s=4, alpha=0.5, color=color, linewidths=0, label=name)
        for kind, marker in (("arrival", "o"), ("turn", "^"), ("background", "x")):
            chosen = [r for r in ok if r.kind == kind]
            if chosen:
                ttft_ax.scatter([r.prompt_len for r in chosen], [r.ttft_s * 1e3 for r in chosen], s=16,
                                marker=marker, color=color, alpha=0.7, label=f"{name} ({kind})")
    itl_ax.set(xlabel="time since start (s)", ylabel="inter-token gap (ms)", yscale="log",
               title="ITL over time (each gap at its token's arrival)")
    ttft_ax.set(xlabel="prompt length (tokens)", ylabel="TTFT (ms)", yscale="log", title="TTFT against prompt length")
    for ax in (itl_ax, ttft_ax):
        ax.grid(True, which="both", alpha=0.3)
        _plain_log_labels(ax)
        if ax.has_data():
            ax.legend(markerscale=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
