"""The simulator's recorded outputs: the scaling plan (with its plot) and the prediction for the next two-GPU run."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from tqdm import tqdm

from client.load_plan import LoadSpec
from client.load_stats import Slo
from planner.costs import RESULTS, Costs
from planner.deployment import Deployment, Serving
from planner.plan import MIXES, deployments, goodput, plan, prefill_counts
from planner.simulation import simulate, summarize
from planner.traffic import Conversations
from planner.validate import calibrate, conversations, recorded_runs

PLAN_GPUS = {8: 60.0, 64: 20.0}  # GPUs -> simulated seconds of arrivals per point (64 GPUs: shorter, for time)
PLOT = RESULTS / "simulate-plan.png"
# the next two-GPU load run: bench.e2e.deployments's load (16 background users, 15% of arrivals 16k tokens)
# at rising rates
PREDICT_LOAD = LoadSpec(rate=2.0, duration=30.0, prompt_len="uniform:512:2048", output_len="128", long_prompt_frac=0.15,
                        long_prompt_len=16384, background_users=16, seed=7)
PREDICT_SLO = Slo(ttft_ms=3000, itl_ms=50)
PREDICT_RATES = (1.0, 2.0, 4.0, 6.0, 8.0)
MEASURE_WITH = ("for R in 1 2 4 6 8: python -m bench.e2e.deployments --devices cuda:0 cuda:1 --kv-transport nccl "
                "--load-args "
                "'--rate R --duration 30 --prompt-len uniform:512:2048 --output-len 128 --background-users 16 "
                "--long-prompt-frac 0.15 --long-prompt-len 16384 --slo-ttft-ms 3000 --slo-itl-ms 50 --seed 7' "
                "--json bench/results/load-rateR-2xh200.json (split, colocated and layered among its deployments)")
PREDICT_DEPLOYMENTS = {
    "auto": Deployment(1, 1, "auto"), "split": Deployment(1, 1, "disaggregated"),
    "colocated": Deployment(0, 2, "colocated"), "layered": Deployment(0, 2, "layered"),
    "partitioned": Deployment(0, 2, "partitioned"),
}


def calibrated_serving(costs: Costs) -> Serving:
    runs = recorded_runs(RESULTS)
    return calibrate(runs, {t: costs for t in {r.transport for r in runs}})


def run_plan(costs: Costs, progress: bool = True, partition_sms: int | None = None) -> dict[str, Any]:
    """The plan for every GPU count and mix, and its plot (not drawn when `partition_sms` overrides the
    decode servers' pick: that plan is a comparison, not the recorded one)."""
    serving = calibrated_serving(costs)
    total = sum(len(list(deployments(g, prefill_counts(g)))) for g in PLAN_GPUS) * len(MIXES)
    bar = tqdm(total=total, desc="planning", unit="deployment", disable=not progress)
    plans: dict[str, Any] = {}
    for gpus, duration in PLAN_GPUS.items():
        for mix in MIXES.values():
            bar.set_postfix(gpus=gpus, mix=mix.name)
            rows = plan(gpus, mix, costs, serving, on_done=lambda: bar.update(1), duration=duration,
                        partition_sms=partition_sms)
            best = max(rows, key=lambda r: float(r["goodput_rps"]))  # type: ignore[arg-type]
            plans[f"{gpus}x{mix.name}"] = {"gpus": gpus, "mix": mix.name, "about": mix.about,
                                           "slo": dataclasses.asdict(mix.slo), "duration_s": duration,
                                           "best": best, "rows": rows}
    bar.close()
    if partition_sms is None:
        plot_plan(plans)
    return {"goodput": "highest arrival rate with >= 90% of requests within the SLO (bisection)",
            "serving": dataclasses.asdict(serving), "plot": PLOT.name, "plans": plans}


def plot_plan(plans: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PLAN_GPUS), len(MIXES), figsize=(5 * len(MIXES), 4 * len(PLAN_GPUS)), squeeze=False)
    for row, gpus in enumerate(PLAN_GPUS):
        for col, mix in enumerate(MIXES):
            ax, rows = axes[row][col], plans[f"{gpus}x{mix}"]["rows"]
            for mode, marker in (("disaggregated", "o-"), ("auto", "s-")):
                points = sorted((r["prefill"], r["goodput_rps"]) for r in rows if r["mode"] == mode)
                ax.plot([p for p, _ in points], [g for _, g in points], marker, label=mode)
            for r in rows:
                if r["prefill"] == 0:
                    ax.axhline(r["goodput_rps"], linestyle=":", linewidth=1, color="grey")
                    ax.annotate(r["mode"], (0.99, r["goodput_rps"]), xycoords=ax.get_yaxis_transform(),
                                ha="right", va="bottom", fontsize=7, color="grey")
            ax.set_title(f"{gpus} H200s, {mix} (dotted: every GPU decodes)")
            ax.set_xlabel("prefill GPUs (the rest decode)")
            ax.set_ylabel("goodput (req/s at 90% SLO)")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def run_prediction(costs: Costs, progress: bool = True, load_args: str | None = None,
                   rates: list[float] | None = None) -> dict[str, Any]:
    """Each deployment's sweep over `rates` under the load that `load_args` (client.load's flags) describe."""
    serving = calibrated_serving(costs)
    load, conversations = _predicted_load(load_args)
    sweep_rates = tuple(rates or PREDICT_RATES)
    runs: dict[str, Any] = {}
    total = len(PREDICT_DEPLOYMENTS) * len(sweep_rates)
    with tqdm(total=total, desc="predicting", unit="run", disable=not progress) as bar:
        for name, deployment in PREDICT_DEPLOYMENTS.items():
            sweep = []
            for rate in sweep_rates:
                spec = dataclasses.replace(load, rate=rate)
                summary = summarize(simulate(deployment, costs, spec, serving, conversations), PREDICT_SLO)
                sweep.append({"rate": rate, **{k: summary[k] for k in ("completed", "goodput_rps", "ttft_ms",
                                                                      "itl_ms", "tpot_ms", "local_share")}})
                bar.update(1)
            runs[name] = {"deployment": deployment.label(), "sweep": sweep,
                          "goodput_at_slo_rps": goodput(deployment, costs, _predict_mix(), serving, start=1.0)}
    measure_with = MEASURE_WITH if load_args is None else (
        f"python -m bench.e2e.deployments --devices cuda:0 cuda:1 --kv-transport nccl --load-args '{load_args}' "
        f"--rates "
        f"{' '.join(f'{r:g}' for r in sweep_rates)} --compare (auto, split, colocated, layered, partitioned)")
    return {"load": {**dataclasses.asdict(load), "rates": list(sweep_rates),
                     "conversations": dataclasses.asdict(conversations)},
            "slo": dataclasses.asdict(PREDICT_SLO), "serving": dataclasses.asdict(serving),
            "goodput_rps": "client.load's goodput: requests within the SLO per second of the run, background included",
            "goodput_at_slo_rps": "highest arrival rate (with the 16 background users) at which >= 90% meet the SLO",
            "measure_with": measure_with,
            "runs": runs}


def _predicted_load(load_args: str | None) -> tuple[LoadSpec, Conversations]:
    """The LoadSpec and turns of client.load's flags, parsed by client.load itself (bench.e2e.deployments's load
    without)."""
    if load_args is None:
        return PREDICT_LOAD, Conversations()
    from client.load import build_parser, load_spec

    spec = load_spec(build_parser().parse_args(shlex.split(load_args)))
    return spec, conversations(spec)


def _predict_mix() -> Any:
    from planner.plan import Mix
    from planner.traffic import Conversations

    return Mix("bench.e2e.deployments", PREDICT_LOAD, Conversations(), PREDICT_SLO,
               "bench.e2e.deployments's default load")
