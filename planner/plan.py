"""Planning with the simulator: goodput at an SLO for a deployment, and the best split of a GPU budget.

Goodput here is DistServe's: the highest arrival rate at which at least `attainment` of the requests
meet the SLO (TTFT and TPOT), found by bisection on the rate of the mix's seeded load.

A partitioned deployment runs its prefills on the SMs its decode servers would pick from their
`sm_split_table.json` with the mix's TPOT limit as `--itl-slo-ms` (planner.validate.table_sms), not the
simulator's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from client.load_plan import LoadSpec
from client.load_stats import Slo
from planner.costs import Costs
from planner.deployment import Deployment, Serving
from planner.network import Network
from planner.simulation import met, simulate
from planner.traffic import Conversations
from planner.validate import table_sms


@dataclass(frozen=True)
class Mix:
    """A traffic mix: its seeded load (the rate is what the search varies), its conversations and its SLO."""

    name: str
    spec: LoadSpec
    conversations: Conversations
    slo: Slo
    about: str


MIXES = {
    "chat": Mix("chat", LoadSpec(duration=60, prompt_len="lognormal:800:0.8", output_len="lognormal:300:0.8", seed=1),
                Conversations(turns="uniform:1:8", new_tokens="lognormal:150:0.8", think_s=5.0),
                Slo(ttft_ms=1000, itl_ms=50),
                "multi-turn chat: 1-8 turns, each re-sending the history plus ~150 new tokens; ~300-token answers"),
    "retrieval": Mix("retrieval", LoadSpec(duration=60, prompt_len="uniform:8192:32768",
                                           output_len="lognormal:200:0.5", seed=2),
                     Conversations(), Slo(ttft_ms=5000, itl_ms=50),
                     "long-context retrieval: one turn, 8k-32k-token prompts of retrieved documents, "
                     "~200-token answers"),
    "code": Mix("code", LoadSpec(duration=60, prompt_len="lognormal:6000:0.6", output_len="lognormal:400:0.8", seed=3),
                Conversations(turns="uniform:2:10", new_tokens="lognormal:400:0.8", think_s=2.0),
                Slo(ttft_ms=2000, itl_ms=30),
                "code assistant: ~6k tokens of repository context, 2-10 edit turns of ~400 new tokens, "
                "~400-token answers"),
}


def attainment(deployment: Deployment, costs: Costs, mix: Mix, rate: float, serving: Serving,
               duration: float | None = None, network: Network | None = None) -> float:
    spec = dataclasses.replace(mix.spec, rate=rate, duration=duration or mix.spec.duration)
    result = simulate(deployment, costs, spec, serving, mix.conversations, network)
    return sum(met(r, mix.slo) for r in result.requests) / max(1, len(result.requests))


def goodput(deployment: Deployment, costs: Costs, mix: Mix, serving: Serving, target: float = 0.9,
            start: float = 1.0, steps: int = 7, duration: float | None = None, network: Network | None = None) -> float:
    """The highest rate (req/s) with attainment >= target: double until it fails, then bisect."""
    def ok(rate: float) -> bool:
        return attainment(deployment, costs, mix, rate, serving, duration, network) >= target

    low, high = 0.0, start
    while ok(high):
        low, high = high, high * 2
        if high > 1e4:
            return low
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


def deployments(gpus: int, prefill_counts: list[int], chunk_size: int = 2048,
                partition_sms: int = Deployment.partition_sms) -> Iterator[Deployment]:
    """Every deployment of a GPU budget the plan compares: all GPUs decoding with each local mode, and each split."""
    for mode in ("colocated", "chunked", "layered", "partitioned"):
        yield Deployment(0, gpus, mode, chunk_size=chunk_size, partition_sms=partition_sms)
    for prefill in prefill_counts:
        if 0 < prefill < gpus:
            yield Deployment(prefill, gpus - prefill, "disaggregated")
            yield Deployment(prefill, gpus - prefill, "auto")


def prefill_counts(gpus: int) -> list[int]:
    """Every split up to 16 GPUs; past that, prefill shares in eighths up to three quarters (time on the CPU)."""
    if gpus <= 16:
        return list(range(1, gpus))
    return sorted({max(1, round(gpus * f / 8)) for f in range(1, 7)})


def plan(gpus: int, mix: Mix, costs: Costs, serving: Serving, on_done: Callable[[], None] | None = None,
         duration: float | None = None, partition_sms: int | None = None) -> list[dict[str, object]]:
    """Each deployment's goodput; a partitioned one's row carries its prefill SMs (`partition_sms`, else the
    decode servers' table pick for the mix's TPOT limit)."""
    rows = []
    per_gpu_start = 0.5
    prefill_sms = partition_sms or table_sms(mix.slo.itl_ms)
    for deployment in deployments(gpus, prefill_counts(gpus), partition_sms=prefill_sms):
        rate = goodput(deployment, costs, mix, serving, start=per_gpu_start * gpus, duration=duration)
        sms = {"prefill_sms": deployment.partition_sms} if deployment.mode == "partitioned" else {}
        rows.append({"deployment": deployment.label(), "mode": deployment.mode, "prefill": deployment.prefill,
                     "decode": deployment.decode, **sms, "goodput_rps": round(rate, 3),
                     "goodput_rps_per_gpu": round(rate / gpus, 4)})
        if on_done is not None:
            on_done()
    return rows
