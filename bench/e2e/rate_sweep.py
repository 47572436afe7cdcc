"""A rate sweep for `bench.e2e.deployments --rates`: each deployment's goodput at the SLO against the offered
rate, beside the simulator's prediction recorded before the run (`planner --predict`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PREDICTION = Path("bench/results/simulate-prediction-2xh200.json")


def sweep_point(rate: float, run: dict[str, Any]) -> dict[str, Any]:
    """The figures of one deployment at one rate that the sweep compares."""
    point = {"rate": rate, "completed": run["completed"], "failed": run["failed"], "goodput_rps": run["goodput_rps"],
             "goodput_itl_p99_rps": run.get("goodput_itl_p99_rps"),
             "request_throughput": run["request_throughput"],
             "ttft_ms": {k: run["ttft_ms"][k] for k in ("p50", "p99")},
             "itl_ms": {k: run["itl_ms"][k] for k in ("p50", "p99")}, "tpot_ms": {"p50": run["tpot_ms"]["p50"]}}
    for key in ("cached_prompt_frac", "placement"):
        if key in run:
            point[key] = run[key]
    return point


def collect(by_rate: dict[float, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{deployment: [its point at each rate, rising]} from {rate: client.load's runs}."""
    sweep: dict[str, list[dict[str, Any]]] = {}
    for rate in sorted(by_rate):
        for name, run in by_rate[rate].items():
            sweep.setdefault(name, []).append(sweep_point(rate, run))
    return sweep


def prediction_for(path: Path, names: list[str]) -> dict[str, Any] | None:
    """The recorded prediction's goodput per rate for these deployments (None without the file)."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    runs = {name: [{"rate": p["rate"], "goodput_rps": p["goodput_rps"], "ttft_ms": p["ttft_ms"],
                    "itl_ms": p["itl_ms"]} for p in doc["runs"][name]["sweep"]]
            for name in names if name in doc.get("runs", {})}
    return {"file": str(path), "date": doc.get("date"), "commit": doc.get("commit"), "command": doc.get("command"),
            "load": doc.get("load"), "runs": runs}


def compared(sweep: dict[str, list[dict[str, Any]]], prediction: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Measured against predicted goodput at each rate both have, with the relative error."""
    rows: list[dict[str, Any]] = []
    if prediction is None:
        return rows
    for name, points in sweep.items():
        predicted = {p["rate"]: p["goodput_rps"] for p in prediction["runs"].get(name, [])}
        for point in points:
            if point["rate"] in predicted and point["goodput_rps"]:
                sim = predicted[point["rate"]]
                rows.append({"deployment": name, "rate": point["rate"], "measured_goodput_rps": point["goodput_rps"],
                             "predicted_goodput_rps": sim,
                             "rel_error": round((sim - point["goodput_rps"]) / point["goodput_rps"], 4)})
    return rows


def plot_sweep(sweep: dict[str, list[dict[str, Any]]], prediction: dict[str, Any] | None, path: str,
               title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for i, (name, points) in enumerate(sweep.items()):
        color = f"C{i}"
        ax.plot([p["rate"] for p in points], [p["goodput_rps"] for p in points], "o-", color=color,
                label=f"{name} (measured)")
        predicted = (prediction or {}).get("runs", {}).get(name)
        if predicted:
            ax.plot([p["rate"] for p in predicted], [p["goodput_rps"] for p in predicted], "x--", color=color,
                    alpha=0.6, label=f"{name} (predicted)")
    ax.set(xlabel="offered arrival rate (req/s, beside the background users)", ylabel="goodput at the SLO (req/s)",
           title=title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
