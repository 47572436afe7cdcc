"""The A/B scenario's earlier runs (`python -m bench.e2e.all_modes`, `client.scenario`), rendered into
docs/results.md and docs/partitioned.md by `python -m bench.readme_tables` from the runs kept under each
file's `previous`: A's gaps and B's time to first token, a row for each length of B and way of prefilling it."""

from __future__ import annotations

from bench.history import Doc, about, caption, gap, run_at, sig, span
from bench.markdown import table

HEADER = ["B", "mode", "A's median gap", "A's worst gap", "slow gaps", "B's TTFT"]
Pick = tuple[str, int | None, str | None]  # mode, chunk size or SM count, KV transport (None: any)


def transport(row: Doc, run: Doc) -> str | None:
    given = row.get("kv_transport", run.get("kv_transport"))
    return given if isinstance(given, str) else None


def find(run: Doc, b_len: int, pick: Pick) -> Doc:
    mode, size, kv = pick
    for row in run["rows"]:
        held = row.get("chunk_size") if mode == "chunked" else row.get("prefill_sms")
        if (row["b_len"], row["mode"]) == (b_len, mode) and held == size and kv in (None, transport(row, run)):
            return row
    raise KeyError(f"no {pick} row at B = {b_len} in the run at {run['commit']}")


def label(pick: Pick, one_gpu: bool = False) -> str:
    mode, size, kv = pick
    if mode == "alone":
        return "A alone"
    if mode == "chunked":
        return f"chunked, {size:,}"
    if mode == "partitioned":
        return f"partitioned, {size} SMs"
    if mode == "disaggregated":
        return "disaggregated (same GPU)" if one_gpu else f"disaggregated, {kv}"
    return mode


def cells(row: Doc) -> list[str]:
    ttft = "-" if row["b_ttft_ms"] is None else f"{row['b_ttft_ms']:,.0f} ms"
    return [f"{sig(row['a_median_gap_ms'])} ms", f"{gap(row['a_worst_gap_ms'])} ms", str(row["a_slow_gaps"]), ttft]


def kb(b_len: int) -> str:
    return f"{b_len // 1024}k"


BASE_2X, DISAGG_2X = "3214e7f", "ae249bf"  # every default row; the disaggregated rows again after 7a6e98c


def scenario_2xh200_history() -> str:
    """Two H200s, 16k and 32k: the disaggregated rows from the newest run, the others from the full one."""
    file = "scenario-2xh200.json"
    base, newer = run_at(file, BASE_2X), run_at(file, DISAGG_2X)
    picks: list[tuple[Pick, Doc]] = [(("alone", None, "nccl"), base), (("disaggregated", None, "nccl"), newer),
                                     (("disaggregated", None, "cuda-ipc"), newer), (("colocated", None, "nccl"), base),
                                     (("chunked", 512, "nccl"), base), (("chunked", 2048, "nccl"), base),
                                     (("layered", None, "nccl"), base)]
    rows = [[kb(b), label(pick) + (f" ({run['commit']})" if run is newer else ""), *cells(find(run, b, pick))]
            for b in (16384, 32768) for pick, run in picks]
    return (caption(about(base, file, "(its `previous`), the rows over nccl"),
                    f"the rows marked {DISAGG_2X}: " + about(newer, file)) + "\n\n" + table(HEADER, rows))


def disaggregated_targets_2xh200() -> str:
    """The disaggregated rows against their targets: A's worst gap over its median, slow gaps, and B's TTFT
    less the prefill server's compute, at the newest run and (in brackets) the full one before it."""
    file = "scenario-2xh200.json"
    base, newer = run_at(file, BASE_2X), run_at(file, DISAGG_2X)
    rows = []
    for kv in ("nccl", "cuda-ipc"):
        for b in (4096, 16384, 32768):
            now, before = (find(run, b, ("disaggregated", None, kv)) for run in (newer, base))
            rows.append([kb(b), kv, f"{now['a_worst_gap_ms'] / now['a_median_gap_ms']:.2f} "
                                    f"({before['a_worst_gap_ms'] / before['a_median_gap_ms']:.2f})",
                         str(now["a_slow_gaps"]), f"{now['b_ttft_ms'] - now['b_server_prefill_ms']:.1f} ms "
                                                  f"({before['b_ttft_ms'] - before['b_server_prefill_ms']:.1f})"])
    header = ["B", "transport", f"worst / median ({BASE_2X})", "slow gaps",
              f"B's TTFT less the prefill's compute ({BASE_2X})"]
    return caption(about(newer, file), f"in brackets, its `previous` at {BASE_2X}") + "\n\n" + table(header, rows)


def scenario_h200_1b5989d() -> str:
    """One H200, both servers on it, every mode at 4k, 16k and 32k (the run at 1b5989d)."""
    file = "scenario-h200.json"
    run = run_at(file, "1b5989d")
    rows = []
    for b in (4096, 16384, 32768):
        sms = (64, 72, 80) if b == 32768 else (72,)
        picks: list[Pick] = [("alone", None, None), ("colocated", None, None), ("chunked", 512, None),
                             ("chunked", 2048, None), ("layered", None, None),
                             *(("partitioned", n, None) for n in sms), ("disaggregated", None, None)]
        rows += [[kb(b), label(pick, one_gpu=True), *cells(find(run, b, pick))] for pick in picks]
    return caption(about(run, file, "(under `previous`)")) + "\n\n" + table(HEADER, rows)


def scenario_layered_2xh200() -> str:
    """`layered` beside colocated and chunked prefill, on the decode server's GPU of a two-H200 machine."""
    file = "scenario-layered-2xh200.json"
    run = run_at(file, "7331303")
    picks: list[Pick] = [("colocated", None, None), ("chunked", 512, None), ("chunked", 2048, None),
                         ("layered", None, None)]
    rows = [[kb(b), label(pick), *cells(find(run, b, pick))] for b in (4096, 16384, 32768) for pick in picks]
    return caption(about(run, file)) + "\n\n" + table(HEADER, rows)


def partitioned_sweep_h200() -> str:
    """B = 32k on one H200, partitioned at each SM count measured, from two runs: a count in both shows
    the range of the two."""
    sources = [("scenario-h200.json", "1b5989d"), ("scenario-partitioned-h200.json", "1bc9daf")]
    found = [(run_at(file, commit), file) for file, commit in sources]
    picks: list[Pick] = [("alone", None, None), ("layered", None, None),
                         *(("partitioned", n, None) for n in (64, 72, 80, 88, 104, 120))]
    rows = []
    for pick in picks:
        got = []
        for run, _ in found:
            try:
                got.append((run["commit"], find(run, 32768, pick)))
            except KeyError:
                continue
        if pick[0] in ("alone", "layered"):
            got = got[:1]  # the sweep's own A alone and layered are in its file, not shown twice
        rs = [r for _, r in got]
        ttft = [r["b_ttft_ms"] for r in rs if r["b_ttft_ms"] is not None]
        worst = list(dict.fromkeys(gap(r["a_worst_gap_ms"]) for r in sorted(rs, key=lambda r: r["a_worst_gap_ms"])))
        rows.append([label(pick), span([r["a_median_gap_ms"] for r in rs], 2, " ms"),
                     "-".join([worst[0], worst[-1]] if len(worst) > 1 else worst) + " ms",
                     span([float(r["a_slow_gaps"]) for r in rs], 0),
                     span(ttft, 0, " ms", thousands=True) if ttft else "-", ", ".join(c for c, _ in got)])
    header = ["mode", "A's median gap", "A's worst gap", "slow gaps", "B's TTFT", "run"]
    return caption(*(about(run, file, "(under `previous`)") for run, file in found)) + "\n\n" + table(header, rows)
