"""`python -m planner`: N prefill x M decode servers under client.load's seeded load, simulated on the CPU.

Costs are fitted to bench/results (the fits and their quality are printed first); the serving loop's
own costs are calibrated on one recorded load run (see planner.validate). Four uses:

  python -m planner --prefill 1 --decode 1 --mode disaggregated --rate 2 --background-users 16 ...
  python -m planner --validate            # replay bench/results/load-*.json, write the comparison
  python -m planner --plan                # best split and mode for 8 and 64 H200s, three mixes
  python -m planner --predict             # the next two-H200 load run, before it is measured
  python -m planner --plan-network        # pools on nodes of their own against per-node, over NIC rates
  python -m planner --costs               # the fitted costs alone, for docs/scaling.md's table
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.load_plan import LoadSpec
from client.load_stats import Slo
from client.provenance import git_commit
from planner.costs import RESULTS
from planner.deployment import MODES, Deployment
from planner.fits import costs_record, describe, fit_costs
from planner.network import GPUS_PER_NODE, NIC_GBPS, NIC_LATENCY_US, POOLS, Network, node_layout
from planner.simulation import simulate, summarize


def build_parser() -> argparse.ArgumentParser:
    d, dep = LoadSpec, Deployment
    p = argparse.ArgumentParser(prog="python -m planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--validate", action="store_true", help="replay the recorded load runs and compare")
    what.add_argument("--plan", action="store_true", help="best split and mode for 8 and 64 GPUs (minutes)")
    p.add_argument("--plan-sms", type=int, default=None,
                   help="--plan: partitioned deployments on this many prefill SMs, not the servers' table pick "
                        "(a comparison: needs --json, draws no plot)")
    what.add_argument("--plan-network", action="store_true",
                      help="split-nodes pools against per-node deployments for 8 and 64 GPUs, over NIC rates (minutes)")
    what.add_argument("--predict", action="store_true", help="predict the next two-GPU load run (rate sweeps)")
    what.add_argument("--costs", action="store_true",
                      help="write the fitted costs (default bench/results/simulate-costs.json), nothing simulated")
    p.add_argument("--load-args", default=None,
                   help="--predict: the client.load flags of the run to predict, as given to bench.e2e.deployments "
                        "(default: bench.e2e.deployments's load, one turn)")
    p.add_argument("--rates", type=float, nargs="+", default=None, help="--predict: the rates of the sweep")
    p.add_argument("--json", metavar="PATH", help="where to write the result (default: a file under bench/results)")
    p.add_argument("--no-progress", action="store_true")
    cluster = p.add_argument_group("deployment")
    cluster.add_argument("--prefill", type=int, default=1, help="prefill servers (1)")
    cluster.add_argument("--decode", type=int, default=1, help="decode servers (1)")
    cluster.add_argument("--mode", choices=MODES, default="disaggregated")
    cluster.add_argument("--chunk-size", type=int, default=dep.chunk_size)
    cluster.add_argument("--partition-sms", type=int, default=dep.partition_sms, help="partitioned: SMs for prefill")
    cluster.add_argument("--auto-local-tokens", type=int, default=dep.auto_local_tokens,
                         help="auto: as the decode server's flag")
    cluster.add_argument("--auto-idle-local-tokens", type=int, default=dep.auto_idle_local_tokens,
                         help="auto: as the decode server's flag")
    cluster.add_argument("--auto-remote-backlog-tokens", type=int, default=dep.auto_remote_backlog_tokens,
                         help="auto: as the decode server's flag")
    cluster.add_argument("--auto-local", default=dep.auto_local, help="auto: the local mode")
    cluster.add_argument("--kv-transport", default="nccl", choices=("nccl", "cuda-ipc"))
    cluster.add_argument("--pools", choices=POOLS, default=dep.pools,
                         help="how the servers sit on nodes: one NVLink domain, per node, or prefill and decode "
                              "on nodes of their own")
    net = p.add_argument_group("network between nodes")
    net.add_argument("--nic-gbps", type=float, default=NIC_GBPS, help=f"NIC per GPU, Gb/s ({NIC_GBPS:g})")
    net.add_argument("--nic-latency-us", type=float, default=NIC_LATENCY_US,
                     help=f"one write across the NICs, us ({NIC_LATENCY_US:g})")
    net.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE, help=f"({GPUS_PER_NODE})")
    load = p.add_argument_group("load (as client.load)")
    load.add_argument("--rate", type=float, default=d.rate)
    load.add_argument("--duration", type=float, default=d.duration)
    load.add_argument("--prompt-len", default=d.prompt_len)
    load.add_argument("--output-len", default=d.output_len)
    load.add_argument("--long-prompt-frac", type=float, default=d.long_prompt_frac)
    load.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len)
    load.add_argument("--background-users", type=int, default=d.background_users)
    load.add_argument("--seed", type=int, default=d.seed)
    load.add_argument("--slo-ttft-ms", type=float)
    load.add_argument("--slo-itl-ms", type=float)
    return p


def stamp(argv: Sequence[str]) -> dict[str, Any]:
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git_commit(),
            "hardware": "simulated (CPU); costs fitted to bench/results from H200 runs",
            "command": shlex.join(["python", "-m", "planner", *argv])}


def write(path: str, record: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        costs = fit_costs(RESULTS, args.kv_transport)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print("fits to bench/results:\n  " + "\n  ".join(describe(costs)))
    try:
        network = Network(args.nic_gbps, args.nic_latency_us, args.gpus_per_node)
    except ValueError as e:
        parser.error(str(e))
    progress = not args.no_progress
    if args.costs:
        write(args.json or str(RESULTS / "simulate-costs.json"), {**stamp(argv), **costs_record(costs)})
        return 0
    if args.validate:
        from planner.validate import validate

        record = validate(RESULTS, progress)
        for row in record["validation"]:
            flag = "" if row["modelled_serving_loop"] is not False else "  (serving loop before the modelled one)"
            print(f"{row['run']:<46} {row['metric']:<12} measured {row['measured']:>9.2f}  simulated "
                  f"{row['simulated']:>9.2f}  {row['rel_error']:+7.1%}{flag}")
        target = record["target_abs_rel_error"]
        print(f"{record['within_target']} of {record['scored_rows']} scored rows within +-{target:.0%}")
        write(args.json or str(RESULTS / "simulate-validation.json"), {**stamp(argv), **record})
        return 0
    if args.plan_network:
        from planner.network_plan import run_network_plan

        write(args.json or str(RESULTS / "simulate-plan-network.json"),
              {**stamp(argv), **run_network_plan(costs, network, progress)})
        return 0
    if args.plan or args.predict:
        from planner.report import run_plan, run_prediction

        if args.plan_sms is not None and not args.json:
            parser.error("--plan-sms: give --json, the recorded plan stays the one on the servers' pick")
        record = (run_plan(costs, progress, args.plan_sms) if args.plan
                  else run_prediction(costs, progress, args.load_args, args.rates))
        default = "simulate-plan.json" if args.plan else "simulate-prediction-2xh200.json"
        write(args.json or str(RESULTS / default), {**stamp(argv), **record})
        return 0
    try:
        spec = LoadSpec(args.rate, args.duration, args.prompt_len, args.output_len, args.long_prompt_frac,
                        args.long_prompt_len, args.background_users, seed=args.seed)
        deployment = Deployment(args.prefill, args.decode, args.mode, args.chunk_size,
                                partition_sms=args.partition_sms, auto_local_tokens=args.auto_local_tokens,
                                auto_idle_local_tokens=args.auto_idle_local_tokens,
                                auto_remote_backlog_tokens=args.auto_remote_backlog_tokens,
                                auto_local=args.auto_local, pools=args.pools)
        node_layout(deployment.pools, deployment.prefill, deployment.decode, network.gpus_per_node)
    except ValueError as e:
        parser.error(str(e))
    from planner.report import calibrated_serving

    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    summary = summarize(simulate(deployment, costs, spec, calibrated_serving(costs), network=network), slo)
    print(json.dumps(summary, indent=1))
    if args.json:
        write(args.json, {**stamp(argv), "params": vars(spec), "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
