"""`python -m bench.readme_tables`: the tables of the README, docs/results.md, docs/scaling.md,
docs/partitioned.md and docs/nixl.md, rendered from the JSON files in bench/results between `<!-- table:NAME -->` and
`<!-- /table -->` markers.

A figure in those tables is never typed: `--check` (and tests/test_readme_tables.py) fails when a
table in a document differs from what its JSON renders, and `python -m bench.headline` re-measures
the files and rewrites the tables. Each table opens with its provenance (date, hardware, commit,
command, file) and, where the run measured it, what the card held: its HBM copy rate and its
sustained bf16 matmul rate, so that figures from different cards can be compared.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import engine_history, planner_tables, scenario_history, serving_history
from bench.ab_tables import (
    later_turns_h200,
    partition_graphs_h200,
    partition_short_first_h100,
    prefill_graphs_h100,
    prefill_server_graphs_h100,
)
from bench.history import LOAD_2X_LABELS, Doc, about, load, runs
from bench.markdown import ms, table
from bench.planner_tables import best_plans, plan_network, planner_costs, replica_counts, validation

DOCUMENTS = (Path("README.md"), Path("docs/results.md"), Path("docs/scaling.md"), Path("docs/partitioned.md"),
             Path("docs/nixl.md"))
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)

def card(doc: Doc) -> str:
    held = doc.get("card")
    if not held:
        return "the card's rates were not measured in this run"
    return (f"the card held {held['hbm_gbps']:,.0f} GB/s HBM copy and {held['bf16_tflops_sustained']:,.0f} "
            "TFLOP/s of sustained bf16 matmul")


def provenance(doc: Doc, file: str, extra: str = "") -> str:
    return f"*{about(doc, file)}; {card(doc)}{extra}.*"


# --- the A/B scenario ---------------------------------------------------------------------------
SCENARIO_LABELS = {
    ("alone", None): "A alone",
    ("colocated", None): "colocated: B's whole prefill on A's GPU",
    ("chunked", 512): "chunked, 512 tokens a step",
    ("chunked", 2048): "chunked, 2,048 tokens a step",
    ("layered", None): "layered: B's prompt a slice of layers a step",
}


def scenario_label(row: Doc, one_gpu: bool) -> str:
    mode = row["mode"]
    if mode == "partitioned":
        return f"partitioned: B's prefill on {row['prefill_sms']} of the 132 SMs, beside A's steps"
    if mode == "disaggregated":
        how = "two processes time-sharing the GPU" if one_gpu else "B's prefill on the other GPU"
        return f"disaggregated, KV over {row.get('kv_transport', '?')}: {how}"
    return SCENARIO_LABELS.get((mode, row.get("chunk_size")), str(mode))


def scenario_rows(file: str, b_len: int, order: list[tuple[str, Any, str | None]]) -> tuple[Doc, list[list[str]]]:
    """The rows at `b_len` in `order` (mode, chunk size or SM count, transport), each from the newest
    run that has it; a row from an older run than the file's own names its commit."""
    newest = load(file)
    rows = []
    for mode, size, transport in order:
        for run in runs(newest):
            found = [r for r in run["rows"] if r["b_len"] == b_len and r["mode"] == mode
                     and (r.get("chunk_size") if mode == "chunked" else r.get("prefill_sms")) in (size, None)
                     and (transport is None or r.get("kv_transport", run.get("kv_transport")) == transport)]
            if found:
                row = {**found[0], "kv_transport": found[0].get("kv_transport", run.get("kv_transport"))}
                label = scenario_label(row, "1x" in run["hardware"])
                if run is not newest:
                    label += f" ({run['commit']})"
                same = row["a_tokens_match_solo"] and row.get("b_first_token_matches") in (True, None)
                rows.append([label, ms(row["a_median_gap_ms"], 2), ms(row["a_worst_gap_ms"]), str(row["a_slow_gaps"]),
                             ms(row["b_ttft_ms"]), "yes" if same else "**no**"])
                break
    return newest, rows


SCENARIO_HEADER = ["B = 32k tokens", "A's median gap", "A's worst gap", "A's slow gaps", "B's TTFT",
                   "tokens identical"]


def scenario_2xh200() -> str:
    order = [("alone", None, "nccl"), ("disaggregated", None, "nccl"), ("disaggregated", None, "cuda-ipc"),
             ("disaggregated", None, "nixl"), ("colocated", None, None), ("chunked", 512, None),
             ("chunked", 2048, None), ("layered", None, None)]
    doc, rows = scenario_rows("scenario-2xh200.json", 32768, order)
    return provenance(doc, "scenario-2xh200.json") + "\n\n" + table(SCENARIO_HEADER, rows)


def scenario_h200(file: str = "scenario-h200.json") -> str:
    order = [("alone", None, None), ("colocated", None, None), ("chunked", 512, None), ("chunked", 2048, None),
             ("layered", None, None), ("partitioned", 72, None), ("disaggregated", None, "cuda-ipc"),
             ("disaggregated", None, "nixl")]
    doc, rows = scenario_rows(file, 32768, order)
    return provenance(doc, file) + "\n\n" + table(SCENARIO_HEADER, rows)


# --- many users ---------------------------------------------------------------------------------
def slo_text(params: Doc) -> str:
    text = (f"goodput counts requests with TTFT ≤ {params['slo_ttft_ms'] / 1e3:g} s "
            f"and TPOT ≤ {params['slo_itl_ms']:g} ms")
    if params.get("slo_itl_p99_ms") is not None:
        text += f"; per-token goodput, TTFT as before and each request's P99 gap ≤ {params['slo_itl_p99_ms']:g} ms"
    return text


def load_h200(file: str = "load-h200.json") -> str:
    doc = load(file)
    per_token = doc["params"].get("slo_itl_p99_ms") is not None
    header = ["mode", "goodput (TPOT SLO)", *(["goodput (per-token SLO)"] if per_token else []), "ITL p99",
              "ITL max", "TTFT p99"]
    rows = []
    for name, run in doc["runs"].items():
        if name in ("prefix-cache", "no-prefix-cache"):
            continue
        label = name if not run.get("prefill_sms") else f"{name}, {run['prefill_sms']} SMs"
        rows.append([label, f"{run['goodput_rps']:.2f} req/s",
                     *([f"{run['goodput_itl_p99_rps']:.2f} req/s"] if per_token else []),
                     ms(run["itl_ms"]["p99"]), ms(run["itl_ms"]["max"]), ms(run["ttft_ms"]["p99"])])
    local = {name: run for name, run in doc["runs"].items() if name not in ("prefix-cache", "no-prefix-cache")}
    by_tpot = best(local, "goodput_rps")
    if not per_token:
        verdict = (f"\n\nUnder the mean-TPOT SLO, {by_tpot} {serves(by_tpot)} the most requests; this run predates "
                   "the per-token SLO.")
    elif (by_token := best(local, "goodput_itl_p99_rps")) == by_tpot:
        verdict = f"\n\n{by_tpot} {serves(by_tpot)} the most requests under both SLOs."
    else:
        verdict = (f"\n\nUnder the mean-TPOT SLO, {by_tpot} {serves(by_tpot)} the most requests; under the "
                   f"per-token SLO, {by_token}.")
    added: dict[tuple[str, str, str], list[str]] = {}  # runs merged in later (`--merge`), by their own run's provenance
    for name, run in local.items():
        if run.get("recorded"):
            added.setdefault((run["recorded"]["commit"], run["recorded"]["date"][:10],
                              run["recorded"]["command"]), []).append(f"`{name}`")
    later = "".join(f"\n\n*{', '.join(names)}: added {date}, commit {commit}, `{command}`.*"
                    for (commit, date, command), names in added.items())
    return (provenance(doc, file, "; " + slo_text(doc["params"])) + later + "\n\n" + table(header, rows)
            + verdict)


def serves(names: str) -> str:
    """The verb for `best`'s names: one run serves, a tie serve."""
    return "serve" if " and " in names else "serves"


def best(runs: dict[str, Doc], key: str) -> str:
    """The run with the most of `key`, with any within 2% of it (a tie at this run's noise)."""
    top = max(run[key] for run in runs.values())
    names = [f"`{name}`" for name, run in runs.items() if run[key] >= 0.98 * top]
    return " and ".join(names) if len(names) <= 2 else ", ".join(names[:-1]) + " and " + names[-1]


def load_2xh200() -> str:
    file = "load-2xh200.json"
    doc = load(file)
    rates = doc["params"]["rates"]
    per_token = doc["params"].get("slo_itl_p99_ms") is not None
    header = ["goodput (requests/s) at", *[f"{r:g} /s" for r in rates]]
    rows = []
    for name, points in sorted(doc["sweep"].items(), key=lambda kv: -kv[1][0]["goodput_rps"]):
        cells = [f"{p['goodput_rps']:.1f}" + (f" / {p['goodput_itl_p99_rps']:.1f}" if per_token else "")
                 for p in points]
        rows.append([LOAD_2X_LABELS.get(name, name), *cells])
    note = "; " + slo_text(doc["params"]) + (" (cells: TPOT / per-token)" if per_token else "")
    return provenance(doc, file, note) + "\n\n" + table(header, rows)


# --- the engine ---------------------------------------------------------------------------------
def engine_h200(file: str = "engine-h200.json") -> str:
    doc = load(file)
    held = {"card": {"hbm_gbps": doc["hbm_gbps_measured"], "bf16_tflops_sustained": doc["bf16_tflops_sustained"]}}
    rows = [[f"decode step, batch {b}", ms(doc["decode_ms"][str(b)], 3),
             f"{doc['decode_tok_per_s'][str(b)]:,.0f} tokens/s", ms(doc["decode_floor_ms"][str(b)], 3)]
            for b in (1, 64) if str(b) in doc["decode_ms"]]
    rows += [[f"prefill, {int(n) // 1024}k tokens", ms(t), f"{int(n) / t * 1e3:,.0f} tokens/s", "-"]
             for n, t in doc["prefill_ms"].items()]
    header = [f"{doc['preset']}, {doc['context']}-token context", "time", "rate", "HBM floor"]
    return provenance({**doc, **held}, file) + "\n\n" + table(header, rows)


def engine_fp8_h200() -> str:
    """The FP8 preset (e4m3 weights; the skinny matmul's W8A16 or W8A8 tiles at 1-64 rows, torch._scaled_mm
    in prefill)."""
    return engine_h200("engine-fp8-h200.json")


def attention_fp8_h200(file: str = "attention-fp8-h200.json") -> str:
    """One layer's causal prefill attention at Qwen2.5-7B's shape: the bf16 route against cuDNN's FP8
    attention (an e4m3 pool's), with the conversions of q, k and v to e4m3 counted."""
    doc = load(file)
    rows = [[f"{r['tokens']:,}", ms(r["bf16_ms"], 2), f"{r['bf16_tflops']:,.0f}", ms(r["fp8_ms"], 2),
             ms(r["fp8_conversions_ms"], 2), f"{r['fp8_tflops_kernel']:,.0f}", f"{r['bf16_ms'] / r['fp8_ms']:.2f}x",
             f"{r['relative_error']:.1%}"] for r in doc["rows"]]
    header = ["prompt tokens", "bf16 (cuDNN)", "its TFLOP/s", "FP8 (cuDNN)", "of which to e4m3", "its TFLOP/s",
              "speed-up", "output's error"]
    about = (f"*{doc['hardware']}, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             f"[`{file}`](bench/results/{file}); the card's bf16 matmul measured {doc['bf16_tflops_measured']:,} "
             "TFLOP/s in this run; FP8's rate leaves out q, k and v's conversion only; the error is the FP8 "
             "output's against the bf16 route's (q, k, v of unit variance).*")
    return about + "\n\n" + table(header, rows)


def grammar_rows_h200() -> str:
    """bench.e2e.grammar_rows, each run in the file newest first: the batch's ITL without grammars, then
    with some of its rows under a JSON schema (the others' ITL is what the grammar rows cost them)."""
    doc = load("grammar-rows-h200.json")
    def p50_mean(itl: Doc) -> str:
        return f"{ms(itl['p50'], 2)} / {ms(itl['mean'], 2)}"

    rows = [[run["commit"], p50_mean(run["itl_ms"]["unconstrained_batch"]),
             p50_mean(run["itl_ms"]["mixed_unconstrained_rows"]), ms(run["itl_ms"]["mixed_grammar_rows"]["p50"], 2),
             f"{run['mixed_over_unconstrained']['mean']:.3f}"] for run in runs(doc)]
    header = ["commit", f"{doc['users']} rows, no grammar: ITL p50 / mean",
              f"{doc['grammar_users']} under a grammar: the others' p50 / mean", "the grammar rows' p50",
              f"ratio of means (target <= {doc['target_ratio']})"]
    about = (f"*{doc['hardware']}, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             "[`grammar-rows-h200.json`](bench/results/grammar-rows-h200.json) (the earlier runs under "
             "`previous`); the mean includes the steps that wait for new requests' prefills.*")
    return about + "\n\n" + table(header, rows)


# --- KV over NIXL -------------------------------------------------------------------------------
def kv_nixl_h200() -> str:
    """bench.e2e.kv_transfer's nixl rows, each run's median: the endpoints (two processes' pools) and the
    servers (what the handoff left exposed beyond the prefill), beside cuda-ipc measured with them."""
    file = "kv_transfer-h200.json"
    rows = [r for r in load(file)["rows"] if r["transport"] == "nixl" or r.get("beside_nixl")]
    groups: dict[tuple[str, str, str, int], list[Doc]] = {}
    for r in rows:
        groups.setdefault((r["transport"], r["mode"], r.get("op", "WRITE"), r["tokens"]), []).append(r)
    cells = []
    for (transport, mode, op, tokens), runs_ in groups.items():
        mid = sorted(runs_, key=lambda r: r["seconds"])[len(runs_) // 2]
        rate = f"{mid['gbps']:,.1f} GB/s" if mid.get("gbps") else "-"
        shown = sorted(r["exposed_ms"] for r in runs_ if r.get("exposed_ms") is not None)
        exposed = f"{ms(shown[len(shown) // 2], 2)} ({shown[0]:.2f}-{shown[-1]:.2f})" if shown else "-"
        cells.append([transport, mode, op if mode == "endpoints" else "-", f"{tokens // 1024}k",
                      f"{mid['bytes'] / 1e9:.2f} GB", ms(mid["seconds"] * 1e3, 2), rate, exposed,
                      "yes" if all(r["bitwise_equal"] for r in runs_) else "**no**"])
    first, last = rows[0], max(rows, key=lambda r: r["date"])
    commands = dict.fromkeys(r["command"].replace(f"--tokens {r['tokens']}", "--tokens N") for r in rows)
    commits = ", ".join(dict.fromkeys(r["commit"] for r in rows))
    doc = {"hardware": first["hardware"], "date": last["date"], "commit": commits,
           "command": "`, then `".join(commands)}
    header = ["transport", "measured", "op", "KV of", "bytes", "time (median)", "rate",
              "exposed beyond the prefill: median (range)", "bytes identical"]
    return provenance(doc, file, f", run with `{first['env']}`") + "\n\n" + table(header, cells)


def hostile_bodies(file: str = "hostile-bodies-cpu.json") -> str:
    """Per case: how it was answered, and the stall it caused at each GIL switch interval measured,
    beside the newest earlier run (under `previous`) that sent it, at the default switch."""
    doc = load(file)
    switches = list(doc["gil_switch_ms"])
    earlier = list(runs(doc))[1:]
    cases: dict[str, list[Doc]] = {}  # every case of the file's own run, as it was answered
    for k in switches:
        for name, trials in doc["gil_switch_ms"][k]["cases"].items():
            cases.setdefault(name, trials)

    def before(name: str) -> str:
        for run in earlier:
            setting = run["gil_switch_ms"].get("5", {})
            if name in setting.get("worst_stall_ms", {}):
                return (f"{ms(setting['worst_stall_ms'][name])} / {ms(setting['median_stall_ms'][name])} "
                        f"({run['commit']})")
        return "-"

    header = ["body", "answer", "answered in (median)",
              *[f"stall, worst / median of {doc['trials']} (switch {k} ms)" for k in switches],
              *(["before: the newest earlier run that sent it (switch 5 ms)"] if earlier else [])]
    rows = []
    for name, trials in cases.items():
        status = sorted({str(t["status"]) for t in trials})
        answered = sorted(t["answered_s"] for t in trials)[len(trials) // 2]
        stalls = [f"{ms(doc['gil_switch_ms'][k]['worst_stall_ms'].get(name))} / "
                  f"{ms(doc['gil_switch_ms'][k]['median_stall_ms'].get(name))}" for k in switches]
        rows.append([name, ", ".join(status), f"{answered:.2f} s", *stalls, *([before(name)] if earlier else [])])
    idle = [t["idle_longest_gap_ms"] for s in doc["gil_switch_ms"].values() for ts in s["cases"].values() for t in ts]
    about = (f"*{doc['hardware']}, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             f"[`{file}`](bench/results/{file}); a stall is the stream's longest token gap while the body was "
             f"answered less the longest of the idle second before (those idle gaps: {min(idle):.0f}-{max(idle):.0f} "
             f"ms); target {doc['target_stall_ms']:g} ms.*")
    return about + "\n\n" + table(header, rows)


TABLES: dict[str, Callable[[], str]] = {
    "scenario-2xh200": scenario_2xh200, "scenario-h200": scenario_h200, "load-h200": load_h200,
    "load-2xh200": load_2xh200, "engine-h200": engine_h200, "simulate-plan-network": plan_network,
    "engine-fp8-h200": engine_fp8_h200, "kv-nixl-h200": kv_nixl_h200, "hostile-bodies-cpu": hostile_bodies,
    "hostile-bodies-h200": lambda: hostile_bodies("hostile-bodies-h200.json"), "grammar-rows-h200": grammar_rows_h200,
    "scenario-fp8-h200": lambda: scenario_h200("scenario-fp8-h200.json"), "load-fp8-h200": lambda: load_h200(
        "load-fp8-h200.json"),
    "engine-fp8-kv-fp8-h200": lambda: engine_h200("engine-fp8-kv-fp8-h200.json"),
    "scenario-fp8-kv-fp8-h200": lambda: scenario_h200("scenario-fp8-kv-fp8-h200.json"),
    "attention-fp8-h200": attention_fp8_h200, "prefill-graphs-h100": prefill_graphs_h100,
    "prefill-server-graphs-h100": prefill_server_graphs_h100, "later-turns-h200": later_turns_h200,
    "partition-graphs-h200": partition_graphs_h200, "partition-short-first-h100": partition_short_first_h100,
    "planner-costs": planner_costs, "simulate-plan": best_plans,
    "simulate-validation": validation, "replica-counts": replica_counts, "serving-costs": planner_tables.serving_costs,
    "prediction-compared": planner_tables.prediction_compared,
    # docs/results.md's history and docs/partitioned.md's sweep, each from the runs its file keeps
    "scenario-2xh200-history": scenario_history.scenario_2xh200_history,
    "scenario-2xh200-targets": scenario_history.disaggregated_targets_2xh200,
    "scenario-h200-1b5989d": scenario_history.scenario_h200_1b5989d,
    "scenario-layered-2xh200": scenario_history.scenario_layered_2xh200,
    "partitioned-sweep-h200": scenario_history.partitioned_sweep_h200,
    "engine-h200-two-cards": engine_history.engine_two_cards, "engine-h200-b30d550": engine_history.engine_b30d550,
    "engine-h200-548117c": engine_history.engine_548117c,
    "engine-h200-9c0f2cd": lambda: engine_history.engine_at("9c0f2cd"),
    "engine-h200-e1b0a1e": lambda: engine_history.engine_at("e1b0a1e"),
    "engine-h200-b6acfe8": lambda: engine_history.engine_beside("b6acfe8", "d3f079b"),
    "engine-h200-47c7708": lambda: engine_history.engine_beside("47c7708", "746cda5", graph=True),
    "engine-h200-a57ddac": engine_history.engine_a57ddac, "kv-handoff": serving_history.kv_handoff,
    "load-h200-c40eebd": serving_history.load_h200_c40eebd, "prefix-cache-h200": serving_history.prefix_cache_h200,
    "load-2xh200-sweep": serving_history.load_2xh200_sweep, "placement-2xh200": serving_history.placement_2xh200,
    "load-2xh200-one-turn": serving_history.load_2xh200_one_turn,
    "load-split-2xh200": serving_history.load_split_2xh200, "nixl-descriptors": serving_history.nixl_descriptors,
}


def render(text: str, document: Path = Path("README.md")) -> str:
    """`text` with every marked table rendered anew from its JSON. The tables link their files from
    the repository's root; in a document inside a folder, those links climb out of it first."""
    up = "../" * (len(document.parts) - 1)

    def fill(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in TABLES:
            raise KeyError(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        return f"{m[1]}{TABLES[name]().replace('](bench/results/', f']({up}bench/results/')}\n{m[4]}"
    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.readme_tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a document's tables differ from their JSON")
    args = p.parse_args(argv)
    stale = []
    for path in DOCUMENTS:
        old = path.read_text()
        new = render(old, path)
        if new != old:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        sys.exit(f"error: tables differ from bench/results in {', '.join(stale)}; run python -m bench.readme_tables")
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing") if stale or not args.check
          else "tables match bench/results")


if __name__ == "__main__":
    main()
