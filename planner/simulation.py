"""A simulated run summarized in the load report's terms (client.load_stats): goodput, TTFT, TPOT and ITL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.load_plan import LoadSpec
from client.load_stats import Slo
from planner.cluster import Cluster
from planner.costs import Costs
from planner.deployment import Deployment, Serving
from planner.network import Network
from planner.traffic import Conversations, SimRequest, Traffic


@dataclass(frozen=True)
class SimResult:
    deployment: Deployment
    requests: list[SimRequest]
    duration_s: float
    step_ends: list[np.ndarray]

    def itl_s(self) -> np.ndarray:
        """Every gap between two tokens of one request, as the client would see them."""
        gaps = []
        for r in self.requests:
            if r.output < 2 or not r.finished:
                continue
            ends = self.step_ends[r.server][r.join_step:r.join_step + r.output - 1]
            gaps.append(np.diff(np.concatenate(([r.first_token], ends))))
        return np.concatenate(gaps) if gaps else np.zeros(0)


def simulate(deployment: Deployment, costs: Costs, spec: LoadSpec, serving: Serving | None = None,
             conversations: Conversations | None = None, network: Network | None = None) -> SimResult:
    cluster = Cluster(deployment, costs, Traffic(spec, conversations or Conversations()), serving, network)
    requests = cluster.run()
    duration = max([spec.duration, *(r.done for r in requests)])
    return SimResult(deployment, requests, duration, [np.asarray(d.step_ends) for d in cluster.decode])


def met(request: SimRequest, slo: Slo) -> bool:
    if not request.finished:
        return False
    if slo.ttft_ms is not None and request.ttft * 1e3 > slo.ttft_ms:
        return False
    return slo.itl_ms is None or (request.tpot or 0.0) * 1e3 <= slo.itl_ms


def _ms(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 3) if len(values) else None


def summarize(result: SimResult, slo: Slo, itl: bool = True) -> dict[str, Any]:
    done = [r for r in result.requests if r.finished]
    summary: dict[str, Any] = {
        "name": result.deployment.label(), "completed": len(done), "duration_s": round(result.duration_s, 3),
        "request_throughput": round(len(done) / result.duration_s, 3),
        "goodput_rps": round(sum(met(r, slo) for r in done) / result.duration_s, 3),
        "slo_attainment": round(sum(met(r, slo) for r in done) / max(1, len(result.requests)), 4),
        "ttft_ms": {"p50": _ms([r.ttft for r in done], 50), "p99": _ms([r.ttft for r in done], 99)},
        "tpot_ms": {"p50": _ms([t for r in done if (t := r.tpot) is not None], 50)},
        "local_share": round(sum(r.where == "local" for r in done) / max(1, len(done)), 3),
    }
    if itl:
        gaps = result.itl_s()
        summary["itl_ms"] = {"p50": _ms(gaps, 50), "p90": _ms(gaps, 90), "p99": _ms(gaps, 99)}
    return summary
