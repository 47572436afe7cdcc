"""docs/scaling.md's tables of the simulator (`python -m planner`), rendered by `python -m bench.readme_tables`
from what it recorded: the costs it fits to bench/results (`--costs`), the serving loop's calibrated costs,
its prediction beside the load run that measured it, and the plans."""

from __future__ import annotations

from collections.abc import Callable

from bench.history import Doc, load
from bench.markdown import table


def rate(us_per_byte: float) -> str:
    return f"{1e-3 / us_per_byte:.1f} GB/s"


def later_turn(p: list[float]) -> str:
    terms = [(p[0], ""), (p[1], "·c"), (p[2], "·P"), (p[3], "·c·(P + c/2)")]
    kept = [f"{v:.3g}{unit}" for v, unit in terms if v]
    dropped = "" if len(kept) == len(terms) else " (terms that fitted negative dropped)"
    return " + ".join(kept) + f" ms{dropped}"


def lab(doc: Doc) -> str:
    points = "; ".join(f"{s} SMs: {step:g} ms, {share:.0%}" for s, (step, share) in doc["partition_lab"].items())
    return (f"the lab's decode steps beside a prefill and its share of the rate ({doc['partition_alone_step_ms']:g} "
            f"ms alone; {points})")


# (the fit's field in the simulator's costs, the cost, what it is fitted to, its form from the fitted parameters)
ROWS: list[tuple[str, str, str, Callable[[list[float]], str]]] = [
    ("attention", "decode attention, a layer",
     "`engine-h200.json`'s kernel profile (batch 1 and 64, 1,024-token contexts) and the lab's one-wave figure",
     lambda p: f"{p[0]:.2f} µs + the longest program's bytes at {rate(p[1])} beside another program, the rest "
               "alone (next row), or the layer's KV at the HBM rate if longer, × 28 layers"),
    ("attention_alone", "a program alone on its SM",
     "`decode-attention-*.json` rows with at most one program an SM (1k-16k contexts, batch 1-32)",
     lambda p: f"{p[0]:.1f} µs + bytes at {rate(p[1])} (used only where the next row has no points)"),
    ("long_history", "the rest of a long history's program",
     "`attention-long-history-h200.json`: one 16k history among 1k ones at batch 8-32",
     lambda p: f"bytes at {rate(p[0])}"),
    ("decode", "decode step", "`engine-h200.json` (and its history), `engine-2xh200.json`",
     lambda p: f"{p[0]:.3f} + {p[1]:.4f}·batch ms + attention"),
    ("prefill", "prefill", "the same runs, at 4k/16k/32k",
     lambda p: f"{p[0]:.2f} + {p[1]:.4g}·T + {p[2]:.3g}·T² ms"),
    ("chunk", "chunk of c after P tokens", "`scenario-*.json` chunked rows",
     lambda p: f"{p[0]:.2f} + {p[1]:.3g}·c + {p[2]:.3g}·c·(P + c/2) ms"),
    ("later_turn", "later turn: c new tokens after P cached", "`engine-later-turns-h200.json`: the turns alone",
     later_turn),
    ("layered", "layered slice", "`scenario-*.json` layered rows",
     lambda p: f"prefill / slices {p[0]:+.2f} ms a slice"),
    ("local_factor", "local prefill in the server", "`scenario-*.json` colocated rows",
     lambda p: f"engine prefill × {p[0]:.4f}"),
    ("partition", "partitioned", "{lab}", lambda p: "decode slowdown and prefill rate, each linear in SMs"),
    ("kv", "KV handoff (NCCL)", "`kv_transfer-2xh200.json` endpoint rows", lambda p: f"{p[0]:.0f} GB/s"),
]


def quality(fit: Doc) -> list[str]:
    r2 = "–" if fit["r2"] != fit["r2"] else f"{fit['r2']:.4f}"  # nan: a constant, which explains no spread
    return [str(fit["points"]), r2, f"{fit['max_rel_error']:.1%}"]


def costs_rows(doc: Doc) -> list[list[str]]:
    fits = {fit["field"]: fit for fit in doc["fits"]}
    rows = [[cost, source.format(lab=lab(doc)), form(fits[field]["params"]), *quality(fits[field])]
            for field, cost, source, form in ROWS if field in fits]
    rows += [[f"a later turn beside a running batch: {fit['name'].split(' (')[0].removeprefix('later turn ')}",
              "the same file's turns beside it", f"the batch's gap less its step and the turn alone: "
              f"{fit['params'][0]:.2f} ms (printed, not charged)", *quality(fit)]
             for fit in doc["fits"] if fit["field"] == "later_turn_beside"]
    rows.append(["KV handoff beyond the prefill", "the servers' 32k handoffs",
                 f"{doc['kv_tail_ms']:.2f} ms at 32k less the bytes a shorter prompt does not move; the prefill "
                 f"worker waits {doc['kv_send_ms']:.2f} ms of it (median exposed)", "–", "–", "–"])
    return rows


def planner_costs(file: str = "simulate-costs.json") -> str:
    """The simulator's costs as `python -m planner --costs` recorded them (every run prints the same fits)."""
    doc = load(file)
    header = ["cost", "fitted to", "form", "points", "R²", "max rel err"]
    about = (f"*fitted on the CPU to bench/results, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             f"[`{file}`](bench/results/{file}).*")
    return about + "\n\n" + table(header, costs_rows(doc))


SERVING = {"step_host_ms_per_seq": "host time a decode step spends per running sequence",
           "local_call_ms": "a local prefill call (whole prompt, chunk or slice) beyond the engine's",
           "remote_prefill_ms": "a prefill server's prefill beyond the engine's",
           "join_local_ms": "admitting a locally prefilled sequence (its first decode step)",
           "join_remote_ms": "admitting a sequence whose KV came from a prefill server"}


def serving_costs(file: str = "simulate-validation.json", plan_file: str = "simulate-plan.json") -> str:
    """The serving loop's costs as the validation calibrated them, and those of the plan that differ."""
    doc, plan = load(file), load(plan_file)
    rows = [[label, f"{doc['serving'][field]:.2g} ms"] for field, label in SERVING.items()]
    moved = [f"{label.split(' (')[0]} {plan['serving'][field]:.2g} ms" for field, label in SERVING.items()
             if f"{plan['serving'][field]:.2g}" != f"{doc['serving'][field]:.2g}"]
    others = f"ran with its own: {', '.join(moved)}, the others as here" if moved else "ran with the same"
    about = (f"*calibrated on the CPU to the training run `{doc['training_run']}`, {doc['date'][:10]}, commit "
             f"{doc['commit']}, `{doc['command']}`, [`{file}`](bench/results/{file}); the plan at {plan['commit']} "
             f"([`{plan_file}`](bench/results/{plan_file})) {others}.*")
    return about + "\n\n" + table(["serving cost", "calibrated"], rows)


PREDICTED = {"partitioned": "partitioned, two GPUs", "layered": "layered, two GPUs", "colocated": "colocated, two GPUs",
             "split": "split (1 prefill + 1 decode GPU)", "auto": "auto on the split pair (simulator's own rule then)"}


def prediction_compared(file: str = "load-2xh200.json") -> str:
    """The load run's goodput beside the simulator's prediction recorded before it (`prediction_compared`)."""
    doc = load(file)
    by: dict[str, list[Doc]] = {}
    for c in doc["prediction_compared"]:
        by.setdefault(c["deployment"], []).append(c)
    rows = [[PREDICTED.get(name, name), " / ".join(f"{c['predicted_goodput_rps']:.1f}" for c in cells),
             " / ".join(f"{c['measured_goodput_rps']:.1f}" for c in cells),
             " / ".join(f"{c['rel_error']:+.0%}".replace("-", "−") for c in cells)]
            for name, cells in sorted(by.items(), key=lambda kv: [*PREDICTED, kv[0]].index(kv[0]))]
    rates = " / ".join(f"{c['rate']:g}" for c in next(iter(by.values())))
    prediction = doc["prediction"]
    where = prediction["file"].rsplit("/", 1)[-1]
    about = (f"*measured: {doc['hardware']}, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             f"[`{file}`](bench/results/{file}); predicted: {prediction['date'][:10]}, commit {prediction['commit']}, "
             f"[`{where}`](bench/results/{where}); error: the prediction's against the measurement.*")
    return about + "\n\n" + table(["deployment", f"predicted goodput at {rates} per s", "measured", "error"], rows)


def plan_network() -> str:
    file = "simulate-plan-network.json"
    doc = load(file)
    net = doc["network"]
    speeds = doc["nic_sweep_gbps"]
    header = ["GPUs", "mix", "best per-node split (req/s)", *[f"split nodes, {g:g} Gb/s" for g in speeds],
              "split nodes win from"]
    rows = []
    for c in doc["comparisons"]:
        best = c["per_node_best"]
        nodes = max(1, c["gpus"] // net["gpus_per_node"])
        split = f"{best['prefill'] // nodes}P+{(c['gpus'] - best['prefill']) // nodes}D"
        per_node = f"{split} a node: {best['goodput_rps']:.1f}"
        cells = [f"{v:.1f} ({v / best['goodput_rps'] - 1:+.0%})" for v in c["split_nodes_best"].values()]
        flip = f"{c['flip_nic_gbps']:g} Gb/s" if c["flip_nic_gbps"] is not None else "never in the sweep"
        rows.append([str(c["gpus"]), c["mix"], per_node, *cells, flip])
    about = (f"*simulated on the CPU, costs fitted to H200 runs, {doc['date'][:10]}, commit {doc['commit']}, "
             f"`{doc['command']}`, [`{file}`](bench/results/{file}); {net['gpus_per_node']} GPUs a node, "
             f"NIC latency {net['nic_latency_us']:g} µs; split-nodes cells: the same split's goodput (req/s) with "
             "the pools on nodes of their own, and against the per-node best.*")
    return about + "\n\n" + table(header, rows)


def deployment(row: Doc) -> str:
    """A plan row's deployment in words: "partitioned, 8 decode GPUs", "disaggregated, 6 prefill + 2 decode"."""
    mode, prefill, decode = row["mode"], row["prefill"], row["decode"]
    if mode == "disaggregated":
        return f"disaggregated, {prefill} prefill + {decode} decode"
    if mode == "auto":
        return f"auto, {prefill} + {decode}"
    return f"{mode_name(row)}, {decode} decode GPUs"


def mode_name(row: Doc) -> str:
    """A plan row's mode as its deployment names it: "chunked:2048 8D" -> "chunked 2048"."""
    return row["deployment"].split()[0].replace(":", " ")


def goodput(row: Doc, earlier: dict[str, float]) -> str:
    """A row's goodput (req/s, three figures), the same deployment's in the plan before in brackets."""
    was = earlier.get(row["deployment"])
    return rps(row["goodput_rps"]) + ("" if was is None else f" ({rps(was)})")


def rps(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def best_plans(file: str = "simulate-plan.json") -> str:
    """Each plan's best deployment and the best of another mode, the plan before it (`previous`) in brackets."""
    doc = load(file)
    before: Doc = doc.get("previous", {}).get("plans", {})
    rows = []
    for key, plan in doc["plans"].items():
        best = plan["best"]
        other = max((r for r in plan["rows"] if r["mode"] != best["mode"]), key=lambda r: r["goodput_rps"])
        earlier = {r["deployment"]: r["goodput_rps"] for r in before.get(key, {}).get("rows", [])}
        rows.append([str(plan["gpus"]), plan["mix"], deployment(best), goodput(best, earlier), deployment(other),
                     goodput(other, earlier)])
    previous = doc.get("previous")
    about = (f"*simulated on the CPU, costs fitted to H200 runs, {doc['date'][:10]}, commit {doc['commit']}, "
             f"`{doc['command']}`, [`{file}`](bench/results/{file})"
             + (f"; in brackets, the plan at {previous['commit']}" if previous else "") + ".*")
    return about + "\n\n" + table(["GPUs", "mix", "best", "goodput", "runner-up", "goodput"], rows)


METRICS = {"goodput_rps": "goodput", "ttft_ms.p50": "TTFT median", "itl_ms.p99": "ITL p99"}


def validation(file: str = "simulate-validation.json") -> str:
    """The recorded load runs replayed (`python -m planner --validate`): each file and commit's scored rows
    within the target, and the rows that miss it (training runs marked)."""
    doc = load(file)
    target = doc["target_abs_rel_error"]
    groups: dict[str, list[Doc]] = {}
    for row in doc["validation"]:
        if row["modelled_serving_loop"]:
            groups.setdefault(row["run"].split(":")[0], []).append(row)
    cells = []
    for group, rows in groups.items():
        within = sum(abs(r["rel_error"]) <= target for r in rows)
        misses = [f"{r['run'].split(':', 1)[1]} {METRICS.get(r['metric'], r['metric'])} {r['rel_error']:+.0%}"
                  for r in rows if abs(r["rel_error"]) > target]
        name, commit = group.split("@")
        training = " (the training run)" if group == doc["training_run"] else ""
        cells.append([f"`{name}` at {commit}{training}", f"{within} of {len(rows)}", "; ".join(misses) or "–"])
    scored = [r for rows in groups.values() for r in rows]
    by_metric = ", ".join(f"{label} in {sum(abs(r['rel_error']) > target for r in scored if r['metric'] == m)}"
                          for m, label in METRICS.items())
    about = (f"*simulated on the CPU, {doc['date'][:10]}, commit {doc['commit']}, `{doc['command']}`, "
             f"[`{file}`](bench/results/{file}): **{doc['within_target']} of {doc['scored_rows']} scored rows within "
             f"±{target:.0%}**; rows that miss, by metric: {by_metric}.*")
    return about + "\n\n" + table(["runs", f"rows within ±{target:.0%}", "what misses"], cells)


def decode_mode(row: Doc, slo: Doc) -> str:
    """The decode servers' `--mode` for a plan row (a partitioned one with the SLO it runs its split under)."""
    if row["mode"] == "partitioned":
        return f"partitioned, `--itl-slo-ms {slo['itl_ms']:g}` ({row['prefill_sms']} prefill SMs)"
    return mode_name(row)


def replica_counts(file: str = "simulate-plan.json", close: float = 0.05) -> str:
    """The scale-out overlay's counts for each plan's best deployment, and the others within `close` of it."""
    doc = load(file)
    rows = []
    for plan in doc["plans"].values():
        best = plan["best"]
        near = [f"{deployment(r)} ({r['goodput_rps'] / best['goodput_rps'] - 1:+.0%})" for r in plan["rows"]
                if r["deployment"] != best["deployment"] and r["goodput_rps"] >= (1 - close) * best["goodput_rps"]]
        rows.append([str(plan["gpus"]), plan["mix"], str(best["prefill"]), str(best["decode"]),
                     decode_mode(best, plan["slo"]), "; ".join(near) or "–"])
    about = f"*the best deployments of [`{file}`](bench/results/{file}) (commit {doc['commit']}).*"
    return about + "\n\n" + table(["GPUs", "mix", "prefill", "decode", "decode `--mode`",
                                   f"within {close:.0%} of it"], rows)
