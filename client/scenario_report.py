"""The scenario's results: one row per B length and mode, their table and their plot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    mode: str
    chunk_size: int | None
    b_len: int
    a_median_gap_ms: float
    a_worst_gap_ms: float
    a_slow_gaps: int
    b_ttft_ms: float | None
    a_tokens_match_solo: bool
    b_first_token_matches: bool | None
    a_first_diff_index: int | None = None
    b_tokens_match_reference: bool | None = None
    b_sent_after_a_token: int | None = None
    b_first_token_during_gap: int | None = None
    b_server_prefill_ms: float | None = None
    b_server_kv_transfer_ms: float | None = None
    a_gaps_ms: list[float] = field(default_factory=list)         # as A's client saw them
    a_server_gaps_ms: list[float] = field(default_factory=list)  # as the decode server stamped them (since_arrival_s)
    prefill_sms: int | None = None  # partitioned: the request's prefill SM count (None: the server's)


def mode_label(row: Row) -> str:
    if row.mode == "alone":
        return "A alone"
    if row.mode == "chunked":
        return f"chunked, {row.chunk_size:,}"
    if row.mode == "partitioned" and row.prefill_sms:
        return f"partitioned, {row.prefill_sms} SMs"
    return row.mode


def _yes(flag: bool | None, diff: int | None = None) -> str:
    if flag is None:
        return "-"
    return "yes" if flag else ("no" if diff is None else f"no (from #{diff})")


def format_table(rows: list[Row]) -> str:
    head = (f"{'B len':>7}  {'mode':<20} {'A median':>9} {'A worst':>10} {'slow':>5} {'B TTFT':>11}  "
            f"{'A = alone':<13} {'B first = ref':<13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ttft = "-" if r.b_ttft_ms is None else f"{r.b_ttft_ms:,.1f} ms"
        lines.append(f"{r.b_len:>7,}  {mode_label(r):<20} {r.a_median_gap_ms:>6.2f} ms {r.a_worst_gap_ms:>7.1f} ms "
                     f"{r.a_slow_gaps:>5} {ttft:>11}  {_yes(r.a_tokens_match_solo, r.a_first_diff_index):<13} "
                     f"{_yes(r.b_first_token_matches):<13}")
    return "\n".join(lines)


def plot_gaps(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b_lens = sorted({r.b_len for r in rows})
    fig, axes = plt.subplots(len(b_lens), 1, figsize=(10, 3.6 * len(b_lens)), squeeze=False)
    for ax, b_len in zip(axes[:, 0], b_lens, strict=True):
        for r in (r for r in rows if r.b_len == b_len):
            (line,) = ax.plot(range(1, len(r.a_gaps_ms) + 1), r.a_gaps_ms, label=mode_label(r), lw=1.2)
            if r.b_first_token_during_gap is not None and 0 <= r.b_first_token_during_gap < len(r.a_gaps_ms):
                i = r.b_first_token_during_gap
                ax.plot([i + 1], [r.a_gaps_ms[i]], marker="o", color=line.get_color())
        trigger = next((r.b_sent_after_a_token for r in rows if r.b_sent_after_a_token is not None), None)
        if trigger is not None:
            ax.axvline(trigger + 1, color="grey", ls="--", lw=0.8, label="B sent")
        ax.set_yscale("log")
        ax.set_xlabel("A's gap index (gap i is between tokens i-1 and i)")
        ax.set_ylabel("gap (ms)")
        ax.set_title(f"A's inter-token gaps, B = {b_len:,} tokens (dot: B's first token arrives)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
