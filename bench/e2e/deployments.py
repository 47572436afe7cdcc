"""`python -m bench.e2e.deployments`: the same seeded many-user load against each deployment (client.load
--compare), recorded with date, hardware, commit and command.

One device: one decode server, colocated against chunked, layered and partitioned (the mode is sent
per request; partitioned's SM split is the server's, e.g. --server-args "--prefill-sms 104"); with
--cache-compare, two decode servers on it instead, one with its prefix cache and one without
(--no-prefix-cache), for a multi-turn load (client.load --turns). The one server runs without its prefix
cache, since every deployment sends it the same prompts; with --prefix-cache it keeps it and each
deployment's ids are relabelled (below), so a chat's later turns find their conversation cached, as
they would in service. Two devices: the split pair
(prefill server on the first, decode server on the second, KV over --kv-transport) against one
decode server per device, colocated, chunked, layered and partitioned, and `auto` on the split
pair (the decode server places each prefill); every server runs at once, each with --kv-cache-gb,
and only the deployment under test gets requests. There the servers keep their prefix caches, so
each deployment's token ids are relabelled by a salt of its own (client.load --distinct-ids): the
same lengths and times, and no run finds another's prompts in a cache.

With --rates, the load runs once per rate (the servers started once, each rate with its own salt)
and the result is a sweep: each deployment's goodput at the SLO against the offered rate, beside
the simulator's prediction (--prediction), plotted with --plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import metadata, write_json
from bench.e2e.rate_sweep import PREDICTION, collect, compared, plot_sweep, prediction_for
from launcher.process import ServerFailed, ServerProcess, start_all, stop_all

LOAD = ("--rate 2 --duration 30 --prompt-len uniform:512:2048 --output-len 128 --background-users 16 "
        "--long-prompt-frac 0.15 --long-prompt-len 16384 --slo-ttft-ms 3000 --slo-itl-ms 50 --slo-itl-p99-ms 50 "
        "--seed 7")


@dataclass
class Server:
    module: str
    port: int
    args: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def layout(devices: list[str], preset: str, kv_transport: str, kv_gb: float | None,
           port: int, server_args: list[str] | None = None,
           cache_compare: bool = False, prefix_cache: bool = False) -> tuple[list[Server], list[str]]:
    """The servers to start (on ports from `port` up) and the --compare items that address them."""
    common = ["--host", "127.0.0.1", "--metrics-port", "0", "--preset", preset, *(server_args or [])]
    http_off = ["--http-port", "0"]  # several decode servers at once; this load is gRPC's
    kv = ["--kv-cache-gb", str(kv_gb)] if kv_gb else []
    if cache_compare:
        on_dev = [*common, *kv, *http_off, "--device", devices[0], "--mode", "colocated"]
        cached, uncached = Server("decode_server", port, on_dev), Server("decode_server", port + 1,
                                                                         [*on_dev, "--no-prefix-cache"])
        return [cached, uncached], [f"prefix-cache={cached.address}@colocated",
                                    f"no-prefix-cache={uncached.address}@colocated"]
    if len(devices) == 1:  # one server takes every deployment's turn at the same prompts: no cache between them
        cache = [] if prefix_cache else ["--no-prefix-cache"]  # unless each deployment's ids are its own
        one = Server("decode_server", port, [*common, *kv, *http_off, "--device", devices[0], "--mode", "colocated",
                                             *cache])
        return [one], [f"colocated={one.address}@colocated", f"chunked-512={one.address}@chunked:512",
                       f"chunked-2048={one.address}@chunked:2048", f"layered={one.address}@layered",
                       f"partitioned={one.address}@partitioned"]
    first, second = devices
    prefill = Server("prefill_server", port + 3, [*common, *kv, "--device", first, "--kv-transport", kv_transport])
    split = Server("decode_server", port, [*common, *kv, *http_off, "--device", second, "--mode", "disaggregated",
                                           "--prefill-addr", prefill.address, "--kv-transport", kv_transport])
    solo = [Server("decode_server", port + i, [*common, *kv, *http_off, "--device", dev, "--mode", "colocated"])
            for i, dev in ((1, first), (2, second))]
    both = ",".join(s.address for s in solo)
    return [prefill, split, *solo], [f"split={split.address}@disaggregated", f"auto={split.address}@auto",
                                     f"colocated={both}@colocated", f"chunked-512={both}@chunked:512",
                                     f"chunked-2048={both}@chunked:2048", f"layered={both}@layered",
                                     f"partitioned={both}@partitioned"]


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.deployments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--devices", nargs="+", default=["cuda:0"], help="one or two devices (default: %(default)s)")
    p.add_argument("--kv-transport", default="auto", help="the split pair's KV transport (two devices)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="each server's KV pool (two devices: default 30, as two servers share each GPU)")
    p.add_argument("--load-args", default=LOAD, help="client.load flags (default: %(default)s)")
    p.add_argument("--compare", nargs="+", default=None, help="client.load --compare items (default: the layout's)")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="the layout's deployments to run, in this order (e.g. auto split colocated)")
    p.add_argument("--port", type=int, default=50071, help="the first of the servers' ports (up to 4)")
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. \"--gil-switch-ms 0.5\" "
                   "(one flag alone: --server-args=--no-cuda-graphs, or argparse takes it for one of these)")
    p.add_argument("--decode-args", default="",
                   help="extra flags for the decode servers only, e.g. \"--auto-local-mode partitioned\" "
                        "(one flag alone: --decode-args=--partitioned-short-first)")
    p.add_argument("--cache-compare", action="store_true",
                   help="one device: a decode server with its prefix cache against one without")
    p.add_argument("--prefix-cache", action="store_true",
                   help="one device: the decode server keeps its prefix cache, each deployment's ids relabelled")
    p.add_argument("--merge", action="store_true",
                   help="add these runs to --json's (each with its own date, commit and command), keeping the rest")
    p.add_argument("--json", default="bench/results/load-h200.json")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="PNG of every deployment's token gaps over time and TTFT against prompt length")
    p.add_argument("--logs", default=None)
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="a rate sweep: the load once per rate (its --rate replaced), the servers started once")
    p.add_argument("--prediction", default=str(PREDICTION),
                   help="the simulator's recorded prediction to set beside a sweep (default: %(default)s)")
    args = p.parse_args()
    if len(args.devices) not in (1, 2) or ((args.cache_compare or args.prefix_cache) and len(args.devices) != 1):
        p.error("--devices takes one or two devices (one with --cache-compare or --prefix-cache)")
    if args.cache_compare and args.prefix_cache:
        p.error("--cache-compare starts a server with its prefix cache and one without; --prefix-cache is for the "
                "one server of the other one-device layout")
    kv_gb = args.kv_cache_gb or (30.0 if len(args.devices) == 2 or args.cache_compare else None)
    servers, compare = layout(args.devices, args.preset, args.kv_transport, kv_gb, args.port, args.server_args.split(),
                              args.cache_compare, args.prefix_cache)
    for server in servers:
        if server.module == "decode_server":
            server.args += args.decode_args.split()
    if args.only:
        by_name = {item.split("=", 1)[0]: item for item in compare}
        if unknown := [n for n in args.only if n not in by_name]:
            p.error(f"--only {' '.join(unknown)}: this layout's deployments are {', '.join(by_name)}")
        compare = [by_name[n] for n in args.only]
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    procs = [ServerProcess(s.module, [*s.args, "--port", str(s.port)], s.address, logs / f"{s.module}-{s.port}.log")
             for s in servers]
    try:
        start_all(procs, timeout=900)
        distinct = ["--distinct-ids"] if (len(servers) > 1 and not args.cache_compare) or args.prefix_cache else []
        by_rate: dict[float, dict[str, Any]] = {}
        for k, rate in enumerate(args.rates or [None]):
            out = logs / f"load-{k}.json"
            sweep_args = ["--rate", str(rate), "--id-salt", str(100 * (k + 1))] if rate is not None else []
            plot = ["--plot", args.plot] if args.plot and not args.rates else []
            cmd = [sys.executable, "-m", "client.load", "--no-progress", "--json", str(out), *args.load_args.split(),
                   *sweep_args, *distinct, "--compare", *(args.compare or compare), *plot]
            if subprocess.run(cmd).returncode != 0:
                sys.exit("error: the load run failed; server logs in " + str(logs))
            doc = json.loads(out.read_text())
            recorded = {**metadata(), "preset": args.preset, "devices": args.devices,
                        "auto_thresholds": auto_thresholds(args),
                        "deployment": describe(args, servers),
                        "servers": [f"python -m {s.module} {' '.join(s.args)} --port {s.port}" for s in servers],
                        "load_command": " ".join(cmd[2:])}
            if rate is None:
                write_json(args.json, merged(Path(args.json), doc, recorded) if args.merge else {**doc, **recorded})
            else:  # written after every rate: a run cut short keeps the rates it finished
                by_rate[rate] = doc["runs"]
                write_json(args.json, sweep_doc(args, by_rate, doc["params"], recorded))
            print(f"wrote {args.json}")
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        stop_all(procs, timeout=60)


def auto_thresholds(args: argparse.Namespace) -> dict[str, int]:
    """The decode servers' mode-auto thresholds in this run, read from --decode-args by the decode server's own
    parser."""
    from decode_server.__main__ import parse_config

    thresholds = parse_config(args.decode_args.split())[0].placement_thresholds
    return {f"auto_{name}": value for name, value in dataclasses.asdict(thresholds).items()}


def describe(args: argparse.Namespace, servers: list[Server]) -> str:
    if args.cache_compare:
        return "two decode servers on one device, one with its prefix cache and one without; no prefill server"
    if len(servers) == 1:
        cache = "with its prefix cache, each deployment's ids its own" if args.prefix_cache else "no prefix cache"
        return f"one decode server on one device ({cache}), no prefill server; prefill_mode sent per request"
    return (f"split and auto: prefill server on {args.devices[0]}, decode server on {args.devices[1]} (KV over "
            f"{args.kv_transport}); colocated, chunked, layered and partitioned: one decode server per device, "
            "requests spread over both")


def sweep_doc(args: argparse.Namespace, by_rate: dict[float, dict[str, Any]], params: dict[str, Any],
              recorded: dict[str, Any]) -> dict[str, Any]:
    """The sweep so far: per deployment its points by rate, the prediction beside them, every run in full."""
    sweep = collect(by_rate)
    prediction = prediction_for(Path(args.prediction), list(sweep))
    if args.plot:
        plot_sweep(sweep, prediction, args.plot, f"{len(args.devices)}x {args.preset}: goodput against rate")
    params = {**params, "rate": None, "rates": sorted(by_rate), "id_salt": "100 x (the rate's index + 1)"}
    return {"params": params, **recorded, "sweep": sweep, "prediction": prediction,
            "prediction_compared": compared(sweep, prediction),
            "runs_by_rate": {str(rate): runs for rate, runs in sorted(by_rate.items())}}


def merged(path: Path, doc: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """The results at `path` with these runs added (replacing runs of the same name), each carrying
    its own parameters and provenance: the file's own describe the runs that were there."""
    if not path.exists():
        return {**doc, **recorded}
    base: dict[str, Any] = json.loads(path.read_text())
    for name, run in doc["runs"].items():
        base.setdefault("runs", {})[name] = {**run, "params": doc["params"], "recorded": recorded}
    return base


if __name__ == "__main__":
    main()
