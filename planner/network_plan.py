"""`python -m planner --plan-network`: prefill and decode pools on nodes of their own against per-node deployments,
priced over a sweep of NIC rates (the KV of a split-nodes handoff crosses the NICs; a per-node one stays on NVLink).

Per-node: every node of `gpus_per_node` runs the same split, its decode servers fed by its own prefill servers;
every split the plan compares is timed. Split-nodes: the prefill pool on nodes of its own, every decode server
fed by the least busy prefill server of the whole pool; timed at each NIC rate on the per-node best split (CPU
time: every split at every rate at 64 GPUs takes hours on two shared cores). The answer flips at the slowest NIC
from which on the split-nodes pools serve at least as much as the best per-node deployment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from planner.costs import RESULTS, Costs
from planner.deployment import Deployment, Serving
from planner.network import Network
from planner.plan import MIXES, Mix, goodput, prefill_counts
from planner.report import calibrated_serving

NIC_SWEEP_GBPS = (10.0, 25.0, 100.0, 400.0, 1600.0)
NETWORK_PLAN_GPUS = {8: 30.0, 64: 10.0}  # GPUs -> simulated seconds of arrivals per point (CPU time)
PLOT = RESULTS / "simulate-plan-network.png"


def flip_gbps(per_node_best: float, split_best: dict[float, float]) -> float | None:
    """The slowest NIC rate from which on the split-nodes pools serve at least the per-node best (None: never)."""
    flip = None
    for gbps in sorted(split_best, reverse=True):
        if split_best[gbps] < per_node_best:
            break
        flip = gbps
    return flip


def per_node_splits(gpus: int, gpus_per_node: int) -> list[int]:
    """Prefill GPUs of every split a per-node deployment can take: the same share on each node."""
    nodes = max(1, gpus // gpus_per_node)
    return [p for p in prefill_counts(gpus) if p % nodes == 0]


def compare(gpus: int, mix: Mix, costs: Costs, serving: Serving, network: Network, speeds: Sequence[float],
            duration: float, bar: tqdm | None = None) -> dict[str, Any]:
    """One GPU count and mix: per-node rows, split-nodes rows at each NIC rate, and where the answer flips."""
    def rate(deployment: Deployment, net: Network) -> float:
        value = goodput(deployment, costs, mix, serving, start=0.5 * gpus, duration=duration, network=net)
        if bar is not None:
            bar.update(1)
        return value

    splits = per_node_splits(gpus, network.gpus_per_node)
    per_node = {p: rate(Deployment(p, gpus - p, "disaggregated", pools="per-node"), network) for p in splits}
    best_p = max(per_node, key=lambda p: per_node[p])
    split_rows: list[dict[str, Any]] = []
    for gbps in speeds:
        net = dataclasses.replace(network, nic_gbps=gbps)
        split = Deployment(best_p, gpus - best_p, "disaggregated", pools="split-nodes")
        split_rows.append({"nic_gbps": gbps, "prefill": best_p, "decode": gpus - best_p,
                           "goodput_rps": round(rate(split, net), 3)})
    split_best = {g: max(r["goodput_rps"] for r in split_rows if r["nic_gbps"] == g) for g in speeds}
    return {"gpus": gpus, "mix": mix.name, "duration_s": duration,
            "per_node": [{"prefill": p, "decode": gpus - p, "goodput_rps": round(v, 3)} for p, v in per_node.items()],
            "per_node_best": {"prefill": best_p, "goodput_rps": round(per_node[best_p], 3)},
            "split_nodes": split_rows, "split_nodes_best": {f"{g:g}": v for g, v in split_best.items()},
            "flip_nic_gbps": flip_gbps(round(per_node[best_p], 3), split_best)}


def run_network_plan(costs: Costs, network: Network, progress: bool = True,
                     speeds: Sequence[float] = NIC_SWEEP_GBPS) -> dict[str, Any]:
    serving = calibrated_serving(costs)
    total = sum(len(per_node_splits(g, network.gpus_per_node)) + len(speeds) for g in NETWORK_PLAN_GPUS)
    comparisons = []
    with tqdm(total=total * len(MIXES), desc="network plan", unit="deployment", disable=not progress) as bar:
        for gpus, duration in NETWORK_PLAN_GPUS.items():
            for mix in MIXES.values():
                bar.set_postfix(gpus=gpus, mix=mix.name)
                comparisons.append(compare(gpus, mix, costs, serving, network, speeds, duration, bar))
    plot(comparisons)
    return {"goodput": "highest arrival rate with >= 90% of requests within the SLO (bisection)",
            "network": dataclasses.asdict(network), "nic_sweep_gbps": list(speeds),
            "pools": {"per-node": "each node the same split, KV over NVLink inside it",
                      "split-nodes": "prefill and decode pools on nodes of their own, KV across the NICs"},
            "plot": PLOT.name, "comparisons": comparisons}


def plot(comparisons: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(NETWORK_PLAN_GPUS), figsize=(6 * len(NETWORK_PLAN_GPUS), 4), squeeze=False)
    for ax, gpus in zip(axes[0], NETWORK_PLAN_GPUS, strict=True):
        for c in (c for c in comparisons if c["gpus"] == gpus):
            best = c["per_node_best"]["goodput_rps"]
            speeds = [float(g) for g in c["split_nodes_best"]]
            ax.plot(speeds, [v / best for v in c["split_nodes_best"].values()], "o-", label=c["mix"])
        ax.axhline(1.0, linestyle=":", color="grey")
        ax.set_xscale("log")
        ax.set_title(f"{gpus} H200s: split-nodes pools / best per-node deployment")
        ax.set_xlabel("NIC per GPU (Gb/s)")
        ax.set_ylabel("goodput ratio (>1: split nodes win)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
