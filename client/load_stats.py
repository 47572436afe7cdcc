"""Summaries of a load run in vLLM benchmark_serving's terms, and their tables (one run, or runs side by side)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.load_run import SERVER_TIMING, Record, RunResult

Summary = dict[str, Any]


@dataclass(frozen=True)
class Slo:
    """Two goodputs over one TTFT limit (None: no limit).

    vLLM's counts a request whose TTFT <= ttft_ms and whose mean gap (TPOT) <= itl_ms. A request with
    one long stall among many short gaps still meets a mean, so the per-token one (DistServe's and
    Sarathi-Serve's P99 TBT) counts a request whose TTFT <= ttft_ms, the P99 of whose own gaps
    <= itl_p99_ms and whose longest gap <= itl_max_ms. A P99 over a 100-token reply passes one stall;
    the max does not.
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None

    def _ttft_met(self, record: Record) -> bool:
        return record.ok and (self.ttft_ms is None or record.ttft_s * 1e3 <= self.ttft_ms)

    def met(self, record: Record) -> bool:
        return self._ttft_met(record) and (self.itl_ms is None or (record.tpot_s or 0.0) * 1e3 <= self.itl_ms)

    def met_per_token(self, record: Record) -> bool:
        if not self._ttft_met(record):
            return False
        gaps_ms = np.asarray(record.gaps_s, dtype=np.float64) * 1e3
        if not gaps_ms.size:
            return True
        if self.itl_p99_ms is not None and np.percentile(gaps_ms, 99) > self.itl_p99_ms:
            return False
        return self.itl_max_ms is None or gaps_ms.max() <= self.itl_max_ms


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in ms (null without data: 0 would read as a measurement)."""
    if not values_s:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    stats = {"mean": ms.mean(), **{f"p{p}": np.percentile(ms, p) for p in (50, 90, 99)}, "max": ms.max()}
    return {k: round(float(v), 3) for k, v in stats.items()}


def _failures(records: Sequence[Record]) -> tuple[dict[str, int], dict[str, str]]:
    failed = [r for r in records if not r.ok]
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.status, r.error_message)
    return dict(Counter(r.status for r in failed)), examples


def summarize(result: RunResult, slo: Slo) -> Summary:
    ok = [r for r in result.records if r.ok]
    duration = result.duration_s
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(len(r.token_times_s) for r in ok)
    failures, examples = _failures(result.records)
    background = [r for r in ok if r.kind == "background"]
    long = [r for r in ok if r.long]
    summary: Summary = {
        "name": result.deployment.name, "targets": list(result.deployment.targets),
        "mode": result.deployment.mode, "chunk_size": result.deployment.chunk_size or None,
        "prefill_sms": result.deployment.prefill_sms or None,
        "completed": len(ok), "failed": len(result.records) - len(ok), "failures": failures,
        "failure_examples": examples, "duration_s": round(duration, 3),
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_tok_per_s": round(output_tokens / duration, 3),
        "total_tok_per_s": round((input_tokens + output_tokens) / duration, 3),
        "goodput_rps": round(sum(slo.met(r) for r in ok) / duration, 3),
        "goodput_itl_p99_rps": round(sum(slo.met_per_token(r) for r in ok) / duration, 3),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.gaps_s]),
        "e2el_ms": distribution_ms([r.token_times_s[-1] - r.sent_s for r in ok]),
    }
    if background:  # the users a long prompt's prefill would stall: the case for disaggregation
        summary["background_itl_ms"] = distribution_ms([g for r in background for g in r.gaps_s])
    if long:
        summary["long_prompt_ttft_ms"] = distribution_ms([r.ttft_s for r in long])
    later = [r for r in ok if r.turn > 1]
    if later:  # conversations: what a prefix cache is for
        summary["later_turn_ttft_ms"] = distribution_ms([r.ttft_s for r in later])
        summary["first_turn_ttft_ms"] = distribution_ms([r.ttft_s for r in ok if r.kind == "arrival"])
    if input_tokens:
        summary["cached_prompt_frac"] = round(sum(r.cached_tokens for r in ok) / input_tokens, 4)
    placements = Counter(r.placement for r in ok if r.placement)
    if placements:
        summary["placement"] = dict(sorted(placements.items()))
    timed = [r.server for r in ok if r.server]
    if timed:  # where the time to first token went, as the decode server saw it (ServerTiming)
        summary["server_mean_ms"] = {k: round(statistics.fmean(t[k] for t in timed) * 1e3, 3) for k in timed[0]}
    return summary


def record_details(record: Record) -> dict[str, Any]:
    """One request for `--json-details`: enough to redo any statistic or plot offline."""
    ok = record.ok and bool(record.token_times_s)
    return {
        "key": record.key, "kind": record.kind, "target": record.target, "status": record.status,
        "error_message": record.error_message or None, "prompt_len": record.prompt_len,
        "max_new_tokens": record.max_new_tokens, "output_tokens": len(record.token_times_s),
        "long_prompt": record.long, "turn": record.turn, "cached_tokens": record.cached_tokens,
        "placement": record.placement or None, "sent_s": round(record.sent_s, 6),
        "ttft_ms": round(record.ttft_s * 1e3, 3) if ok else None,
        "tpot_ms": round(t * 1e3, 3) if ok and (t := record.tpot_s) is not None else None,
        "token_times_s": [round(t, 6) for t in record.token_times_s],
        "server": {k: round(v, 6) for k, v in record.server.items()},
    }


# --- tables ---------------------------------------------------------------------------------------
Row = tuple[str, str]  # (label, summary key) ; a label with an empty key is a section title

SECTIONS = (("ttft_ms", "Time to First Token", "TTFT"),
            ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
            ("itl_ms", "Inter-token Latency", "ITL"),
            ("background_itl_ms", "Background users' ITL", "ITL"),
            ("long_prompt_ttft_ms", "Long prompts' TTFT", "TTFT"),
            ("first_turn_ttft_ms", "Conversations' first turn TTFT", "TTFT"),
            ("later_turn_ttft_ms", "Conversations' later turns TTFT", "TTFT"))
STAT_LABELS = (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99"), ("max", "Max"))


def table_rows(summaries: Sequence[Summary]) -> list[Row]:
    rows: list[Row] = [("Successful requests", "completed"), ("Failed requests", "failed"),
                       ("Benchmark duration (s)", "duration_s"), ("Total input tokens", "input_tokens"),
                       ("Total generated tokens", "output_tokens"),
                       ("Request throughput (req/s)", "request_throughput"),
                       ("Output token throughput (tok/s)", "output_tok_per_s"),
                       ("Total token throughput (tok/s)", "total_tok_per_s"), ("Goodput (req/s)", "goodput_rps"),
                       ("Goodput, per-token SLO (req/s)", "goodput_itl_p99_rps"),
                       ("Prompt tokens from a prefix cache (frac)", "cached_prompt_frac")]
    for key, title, short in SECTIONS:
        if any(key in s for s in summaries):
            rows.append((title, ""))
            stats = STAT_LABELS if short == "ITL" else STAT_LABELS[:-1]
            rows += [(f"{label} {short} (ms)", f"{key}.{stat}") for stat, label in stats]
    if any("placement" in s for s in summaries):
        rows += [("Prefills run locally", "placement.local"), ("Prefills run remotely", "placement.remote")]
    if any("server_mean_ms" in s for s in summaries):
        rows.append(("Decode server's timing, mean", ""))
        rows += [(f"{label} (ms)", f"server_mean_ms.{key}") for key, label in SERVER_TIMING.items()]
    return rows


def _value(summary: Summary, key: str) -> str:
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def _failure_lines(summaries: Sequence[Summary], named: bool) -> list[str]:
    lines = []
    for s in summaries:
        for code, count in s["failures"].items():
            prefix = f"{s['name']}: " if named else ""
            lines.append(f"  {prefix}{code} x{count}: {s['failure_examples'][code]}")
    return lines


def format_summary(summary: Summary, slo: Slo) -> str:
    """One run, laid out like vLLM's benchmark_serving result block."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    for label, key in table_rows([summary]):
        if not key:
            lines.append("{s:{c}^50}".format(s=label, c="-"))
        elif key.split(".")[0] in summary:
            lines.append(f"{label + ':':<40}{_value(summary, key):>10}")
    lines.append("=" * 50)
    return "\n".join(lines + _failure_lines([summary], named=False) + [slo_note(slo)])


def format_side_by_side(summaries: Sequence[Summary], slo: Slo) -> str:
    """Runs as columns, metrics as rows: the same seeded load against each deployment."""
    names = [s["name"] for s in summaries]
    modes = [_mode_label(s) for s in summaries]
    widths = [max(10, len(n), len(m)) for n, m in zip(names, modes, strict=True)]
    lines = [f"{'':<40}" + "".join(f"  {n:>{w}}" for n, w in zip(names, widths, strict=True)),
             f"{'mode':<40}" + "".join(f"  {m:>{w}}" for m, w in zip(modes, widths, strict=True))]
    for label, key in table_rows(summaries):
        if not key:
            lines.append(f"-- {label} " + "-" * max(0, 36 - len(label) + sum(w + 2 for w in widths)))
        else:
            lines.append(f"{label:<40}" + "".join(f"  {_value(s, key):>{w}}" for s, w in zip(summaries, widths,
                                                                                          strict=True)))
    return "\n".join(lines + _failure_lines(summaries, named=True) + [slo_note(slo)])


def _mode_label(summary: Summary) -> str:
    mode = summary["mode"] or "server's"
    size = {"chunked": summary["chunk_size"], "partitioned": summary.get("prefill_sms")}.get(mode)
    return f"{mode}:{size}" if size else mode


def slo_note(slo: Slo) -> str:
    limits = []
    if slo.ttft_ms is not None:
        limits.append(f"TTFT <= {slo.ttft_ms:g} ms")
    if slo.itl_ms is not None:
        limits.append(f"TPOT <= {slo.itl_ms:g} ms")
    note = "goodput: completed requests with " + (" and ".join(limits) if limits else "no SLO (all count)")
    gaps = [f"{stat} gap <= {limit:g} ms" for stat, limit in (("P99", slo.itl_p99_ms), ("longest", slo.itl_max_ms))
            if limit is not None]
    return note + "; per-token goodput: TTFT as above and each request's " + (" and ".join(gaps) or "gaps unlimited")
