"""`--validate`: replay every recorded load run (bench/results/load-*.json) and compare with what was measured.

The serving loop's two costs (`Serving`) are calibrated on one recorded run, the training run, from
figures the validation does not score (its ITL median and the servers' mean prefill time); every
other run is predicted from the engine, scenario and handoff fits alone.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from client.load_plan import LoadSpec
from client.load_stats import Slo
from planner.costs import PRESET, RESULTS, Costs, layered_slices
from planner.deployment import Deployment, Serving
from planner.fits import fit_costs
from planner.simulation import SimResult, simulate, summarize
from planner.traffic import Conversations

TRAINING = ("load-2xh200.json", "f96f1c6")   # (file, commit) of the run the serving costs are calibrated on
MODELLED_FROM = "6a78760"                    # pinned token reads: the serving loop the simulator models starts here
METRICS = (("goodput_rps", ("goodput_rps",)), ("ttft_ms.p50", ("ttft_ms", "p50")), ("itl_ms.p99", ("itl_ms", "p99")))
TARGET = 0.15


@dataclass(frozen=True)
class RecordedRun:
    """One deployment's run in a recorded load file."""

    file: str
    commit: str
    name: str
    spec: LoadSpec
    slo: Slo
    deployment: Deployment
    transport: str
    measured: dict[str, Any]

    @property
    def label(self) -> str:
        via = f" ({self.transport})" if self.deployment.mode == "disaggregated" else ""
        return f"{self.file}@{self.commit}:{self.name}{via}"


def _spec(params: dict[str, Any]) -> LoadSpec:
    fields = LoadSpec.__dataclass_fields__
    # the id salt relabels token ids, which the simulator never sees
    return LoadSpec(**{k: v for k, v in params.items() if k in fields and k != "id_salt"})


def conversations(spec: LoadSpec) -> Conversations:
    """client.load's turns as the simulator's: every later turn sent, past the duration too."""
    if spec.turns <= 1:
        return Conversations()
    return Conversations(turns=str(spec.turns), new_tokens=spec.turn_prompt_len or spec.prompt_len, finish=True)


# the decode server's auto thresholds a run used (its record's `auto_thresholds`), else the defaults before they
# were measured (decode_server.config before 096a6de)
AUTO_BEFORE = {"auto_local_tokens": 512, "auto_idle_local_tokens": 2048, "auto_remote_backlog_tokens": 32768}


def _prefix_cache(summary: dict[str, Any], servers: list[str], name: str) -> bool:
    """Whether the run's decode servers kept their prefix caches: from their recorded command lines, or, for a
    run recorded without them, bench.e2e.deployments --cache-compare's name for the server without one."""
    ports = {t.rsplit(":", 1)[-1] for t in summary["targets"]}
    own = [s for s in servers if s.rsplit("--port ", 1)[-1].split()[0] in ports]
    return not all("--no-prefix-cache" in s for s in own) if own else name != "no-prefix-cache"


# partitioned mode's split of the SMs when --prefill-sms is not given: the decode server picks it from this table
# (decode_server.sm_split; unchanged since before the first partitioned load run)
SM_SPLIT_TABLE = Path(__file__).parent.parent / "decode_server" / "sm_split_table.json"


def _flag(servers: list[str], name: str) -> str | None:
    """The value of a decode server's `name` flag in the run's recorded command lines (the first that gives it)."""
    for command in servers:
        words = shlex.split(command)
        if "-m" in words and "decode_server" in words and name in words[:-1]:
            return words[words.index(name) + 1]
    return None


def table_sms(itl_slo_ms: float | None, table: Path = SM_SPLIT_TABLE) -> int:
    """The prefill SMs a decode server started without --prefill-sms picks for `itl_slo_ms` (its --itl-slo-ms; None:
    its default, twice the table's step alone): the most SMs whose measured gap for a decoding request is within it,
    as decode_server.sm_split picks them."""
    doc = json.loads(table.read_text())
    limit = itl_slo_ms if itl_slo_ms is not None else 2 * float(doc["decode_step_alone_ms"])
    fits = [int(r["prefill_sms"]) for r in doc["rows"] if float(r["a_gap_ms"]) <= limit]
    if not fits:
        raise ValueError(f"no split in {table.name} keeps a decoding request's gap within {limit:g} ms")
    return max(fits)


def prefill_sms(servers: list[str], table: Path = SM_SPLIT_TABLE) -> int:
    """The SMs a partitioned prefill ran on: the servers' --prefill-sms, else their table's pick for their
    --itl-slo-ms (table_sms)."""
    given = _flag(servers, "--prefill-sms")
    if given is not None:
        return int(given)
    slo = _flag(servers, "--itl-slo-ms")
    return table_sms(float(slo) if slo is not None else None, table)


def _deployment(summary: dict[str, Any], auto: dict[str, int] | None = None, cache: bool = True,
                partition_sms: int = Deployment.partition_sms) -> Deployment:
    mode, targets = summary["mode"], len(summary["targets"])
    if mode == "auto":
        t = auto or AUTO_BEFORE
        return Deployment(prefill=targets, decode=targets, mode=mode, auto_local_tokens=t["auto_local_tokens"],
                          auto_idle_local_tokens=t["auto_idle_local_tokens"],
                          auto_remote_backlog_tokens=t["auto_remote_backlog_tokens"], prefix_cache=cache)
    if mode == "disaggregated":
        return Deployment(prefill=targets, decode=targets, mode=mode, prefix_cache=cache)
    return Deployment(prefill=0, decode=targets, mode=mode, chunk_size=summary.get("chunk_size") or 512,
                      prefix_cache=cache, partition_sms=summary.get("prefill_sms") or partition_sms)


def _records(record: dict[str, Any], file: str) -> Iterator[RecordedRun]:
    """A load record (`runs` by name, `params`, `commit`), its `previous`, and the records a list of runs holds;
    none of a record of another preset than the costs' (`costs.PRESET`; the FP8 preset's steps and prefills are
    not the engine's the costs are fitted to), records before presets were named being of it."""
    if record.get("preset", PRESET) != PRESET:
        if isinstance(record.get("previous"), dict):
            yield from _records(record["previous"], file)
        return
    if isinstance(record.get("runs"), list):
        for inner in record["runs"]:
            yield from _records(inner, file)
        return
    if "runs_by_rate" in record:  # a rate sweep (bench.e2e.deployments --rates): one record a rate
        for rate, runs in record["runs_by_rate"].items():
            at_rate = {**record, "params": {**record["params"], "rate": float(rate)}, "runs": {
                f"{name}@{float(rate):g}": run for name, run in runs.items()}}
            del at_rate["runs_by_rate"]
            yield from _records({k: v for k, v in at_rate.items() if k != "previous"}, file)
        if isinstance(record.get("previous"), dict):
            yield from _records(record["previous"], file)
        return
    if "params" in record:
        spec, commit = _spec(record["params"]), str(record["commit"])
        transport = record.get("kv_transport") or _transport(record.get("command", ""))
        for name, summary in record["runs"].items():
            # a run merged into the file (bench.e2e.deployments --merge) carries its own parameters and provenance
            own = summary.get("recorded", {})
            params = summary.get("params", record["params"])
            run_spec = _spec(params) if "params" in summary else spec
            run_slo = Slo(params.get("slo_ttft_ms"), params.get("slo_itl_ms"))
            servers = own.get("servers", []) if "recorded" in summary else record.get("servers", [])
            cache = _prefix_cache(summary, servers, name)
            sms = prefill_sms(servers) if summary["mode"] == "partitioned" else Deployment.partition_sms
            deployment = _deployment(summary, record.get("auto_thresholds"), cache, sms)
            yield RecordedRun(file, str(own.get("commit", commit)), name, run_spec, run_slo, deployment, transport,
                              summary)
    if isinstance(record.get("previous"), dict):
        yield from _records(record["previous"], file)


def _transport(command: str) -> str:
    words = command.split()
    return words[words.index("--kv-transport") + 1] if "--kv-transport" in words else "nccl"


def recorded_runs(results: Path = RESULTS) -> list[RecordedRun]:
    runs: list[RecordedRun] = []
    for path in sorted(results.glob("load-*.json")):
        runs.extend(_records(json.loads(path.read_text()), path.name))
    return runs


def modelled(commit: str, repo: Path = RESULTS) -> bool | None:
    """Whether a run's commit descends from MODELLED_FROM (None when git cannot tell)."""
    try:
        out = subprocess.run(["git", "merge-base", "--is-ancestor", MODELLED_FROM, commit], cwd=repo,
                             capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(out.returncode)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = summary
    for part in path:
        value = value[part]
    return float(value)


def _mean_batch(result: SimResult) -> float:
    steps = sum(len(s) for s in result.step_ends)
    tokens = sum(r.output - 1 for r in result.requests if r.finished)
    return tokens / max(1, steps)


def calibrate(runs: list[RecordedRun], costs: dict[str, Costs], rounds: int = 30) -> Serving:
    """Fixed-point fit of the serving costs to the training run's deployments, from figures no validation row
    scores: each one's ITL median and mean TPOT, and its servers' mean prefill time. The simulated figures are
    noisy (one seeded run each), so each round moves a cost by a shrinking share of what it is owed."""
    training = [r for r in runs if (r.file, r.commit) == TRAINING]
    if not training:
        raise ValueError(f"the training run {TRAINING} is not among the recorded load runs")
    serving = Serving()
    for k in range(rounds):
        moves: dict[str, list[float]] = {name: [] for name in vars(serving)}
        for run in training:
            result = simulate(run.deployment, costs[run.transport], run.spec, serving, conversations(run.spec))
            done = [r for r in result.requests if r.finished]
            remote = run.deployment.mode == "disaggregated"
            # where the median gap is a plain decode step and every join adds to the mean TPOT in proportion (chunks
            # between steps put chunked's median on a knife edge: half its gaps hold a chunk or not). The 90th
            # percentile gap is not a join's: it is a step with a long history in it, which no join cost moves.
            if run.deployment.mode in ("disaggregated", "colocated"):
                gaps = result.itl_s() * 1e3
                moves["step_host_ms_per_seq"].append(
                    (run.measured["itl_ms"]["p50"] - float(np.percentile(gaps, 50))) / _mean_batch(result))
                tpot = float(np.mean([t for r in done if (t := r.tpot) is not None])) * 1e3
                joins_per_token = len(done) / max(1, sum(r.output - 1 for r in done)) * _mean_batch(result)
                moves["join_remote_ms" if remote else "join_local_ms"].append(
                    (run.measured["tpot_ms"]["mean"] - tpot) / joins_per_token)
            prefill = float(np.mean([r.prefill_s for r in done])) * 1e3
            pieces = float(np.mean([_pieces(run.deployment, r.prompt) for r in done]))
            measured_prefill = run.measured.get("server_mean_ms", {}).get("prefill_s", prefill)
            moves["remote_prefill_ms" if remote else "local_call_ms"].append((measured_prefill - prefill) / pieces)
        gain = 0.7 / (1.0 + 0.3 * k)
        serving = Serving(**{name: max(0.0, value + gain * float(np.mean(moves[name])) if moves[name] else value)
                             for name, value in vars(serving).items()})
    return serving


def _pieces(deployment: Deployment, prompt: int) -> int:
    """Engine calls a local prefill takes (1 for a prefill server's)."""
    if deployment.mode == "chunked":
        return -(-prompt // deployment.chunk_size)
    if deployment.mode == "layered":
        return layered_slices(prompt, deployment.layer_slice_tokens)
    return 1


def validate(results: Path = RESULTS, progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm

    runs = recorded_runs(results)
    costs = {t: fit_costs(results, t) for t in sorted({r.transport for r in runs})}
    serving = calibrate(runs, costs)
    rows, runs_out = [], []
    for run in tqdm(runs, desc="replaying load runs", disable=not progress):
        simulated = summarize(simulate(run.deployment, costs[run.transport], run.spec, serving,
                                       conversations(run.spec)), run.slo)
        in_model = modelled(run.commit, results)
        # a partitioned run's prefill SMs, as its decode server picked them (see prefill_sms)
        sms = {"prefill_sms": run.deployment.partition_sms} if run.deployment.mode == "partitioned" else {}
        runs_out.append({"run": run.label, "deployment": run.deployment.label(), **sms, "transport": run.transport,
                         "training": (run.file, run.commit) == TRAINING, "modelled_serving_loop": in_model,
                         "simulated": simulated})
        for metric, path in METRICS:
            measured, sim = _get(run.measured, path), _get(simulated, path)
            rows.append({"run": run.label, "metric": metric, "measured": measured, "simulated": sim,
                         "rel_error": round((sim - measured) / measured, 4) if measured else None,
                         "training": (run.file, run.commit) == TRAINING, "modelled_serving_loop": in_model})
    scored = [r for r in rows if r["modelled_serving_loop"] is not False and r["rel_error"] is not None]
    return {"target_abs_rel_error": TARGET, "training_run": "@".join(TRAINING),
            "serving": {k: round(v, 4) for k, v in vars(serving).items()},
            "within_target": sum(abs(r["rel_error"]) <= TARGET for r in scored), "scored_rows": len(scored),
            "validation": rows, "runs": runs_out}
