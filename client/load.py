"""`python -m client.load`: many users at once against a running deployment, reported like vLLM's benchmark_serving.

Prompts arrive as a Poisson process at --rate req/s for --duration s, their prompt and output
lengths drawn from distributions; --background-users K users decode back to back the whole time
(user A of the scenario, K times over). With --turns N each arrival is a conversation: every later
turn re-sends the history (prompts and answers so far) plus a new user message. Every random choice
comes from --seed, prompts are token ids, and ignore_eos is set, so two runs send the identical load
(a conversation's later turns carry the answers the server gave). --compare sends that same load to
several deployments or modes one after another and prints them side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.event_loop import run_event_loop
from client.load_plan import LoadSpec, build_plan
from client.load_run import APIS, MODES, Deployment, LoadRunner, RunResult
from client.load_stats import Slo, Summary, format_side_by_side, format_summary, record_details, summarize
from client.provenance import git_commit

COMPARE = re.compile(r"^(?P<name>[\w.\-]+)=(?P<targets>[^@]*)(?:@(?P<mode>[a-z]+)(?::(?P<chunk>\d+))?)?$")

EXAMPLES = """\
lengths: N (fixed), uniform:LO:HI (inclusive), lognormal:MEAN:SIGMA (MEAN = the lengths' mean,
SIGMA = the underlying normal's sigma). Prompts are random token ids in [0, 256).

goodput (vLLM's definition): completed requests per second whose TTFT <= --slo-ttft-ms and
whose TPOT (time per output token after the first) <= --slo-itl-ms; an SLO left out is no limit.
per-token goodput: the same TTFT limit, and each request's own inter-token gaps: their P99
<= --slo-itl-p99-ms and their longest <= --slo-itl-max-ms (a mean TPOT hides a single long stall).

--compare NAME=TARGETS[@MODE[:CHUNK]] ...: one run per item, the same seeded load each time.
  TARGETS is host:port[,host:port...] (round-robin), or empty for --target's list; MODE
  (disaggregated, colocated, chunked, layered, partitioned, auto) is sent as each request's
  prefill_mode, default --mode; CHUNK overrides --chunk-size for chunked, and the server's
  --prefill-sms for partitioned.
  A target that is a URL (http://host:port/v1) is sent to over the OpenAI API, whatever --api says.

--api openai: the same requests as /v1/completions streams (prompt as token ids, ignore_eos,
  prefill_mode, chunk_size and prefill_sms as extra fields) to targets given as host:port of the
  HTTP API (--http-port) or as URLs; no server timing comes back over HTTP.

examples:
  python -m client.load --target 127.0.0.1:50051 --rate 4 --duration 60 \\
      --prompt-len uniform:512:4096 --output-len 256 --background-users 8 --long-prompt-frac 0.1
  python -m client.load --api openai --target 127.0.0.1:8000 --rate 4 --duration 60
  python -m client.load --rate 2 --duration 60 --background-users 16 --prompt-len 1024 \\
      --long-prompt-frac 0.2 --long-prompt-len 16384 --slo-ttft-ms 2000 --slo-itl-ms 50 \\
      --compare split=gpu-a:50051@disaggregated auto=gpu-a:50051@auto \\
                colocated=gpu-a:50061,gpu-b:50061@colocated chunked=gpu-a:50071,gpu-b:50071@chunked:512 \\
                --json load.json --plot load.png
  python -m client.load --target 127.0.0.1:50051 --rate 1 --duration 60 --turns 4 --prompt-len 2048 \\
      --turn-prompt-len uniform:64:512 --output-len 128    # chats: 4 turns, each re-sending the history
"""


def build_parser() -> argparse.ArgumentParser:
    d = LoadSpec  # defaults live on the dataclass
    p = argparse.ArgumentParser(prog="python -m client.load", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("where")
    where.add_argument("--target", action="append", default=[], metavar="HOST:PORT[,HOST:PORT]",
                       help="decode server(s); repeat or comma-separate for client-side round-robin")
    where.add_argument("--compare", nargs="+", metavar="NAME=TARGETS[@MODE[:CHUNK]]",
                       help="run the same load against each, one after another; see below")
    where.add_argument("--mode", choices=MODES, help="prefill_mode sent with every request (default: the server's)")
    where.add_argument("--chunk-size", type=int, default=0, help="chunk_size sent for chunked (0: the server's)")
    where.add_argument("--api", choices=APIS, default="grpc",
                       help="grpc (pd.v1.Decode) or openai (/v1/completions over HTTP); default grpc")
    where.add_argument("--tls-ca", help="PEM CA bundle: connect with TLS (gRPC)")
    where.add_argument("--openai-extra-body", type=json_object, default=None, metavar="JSON",
                       help="openai: fields added to every request, e.g. '{\"logprobs\": 5}'")
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=float, default=d.rate, help=f"Poisson arrivals per second (default {d.rate})")
    load.add_argument("--duration", type=float, default=d.duration,
                      help=f"seconds of arrivals; in-flight requests then finish (default {d.duration})")
    load.add_argument("--prompt-len", default=d.prompt_len, help=f"prompt length distribution ({d.prompt_len})")
    load.add_argument("--output-len", default=d.output_len, help=f"output length distribution ({d.output_len})")
    load.add_argument("--long-prompt-frac", type=float, default=d.long_prompt_frac,
                      help="fraction of arrivals that get --long-prompt-len instead (default 0)")
    load.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len, help=f"({d.long_prompt_len})")
    load.add_argument("--background-users", type=int, default=d.background_users,
                      help="users that send a request, stream it to the end, and send the next until --duration")
    load.add_argument("--background-prompt-len", help="their prompt lengths (default: --prompt-len)")
    load.add_argument("--background-output-len", help="their output lengths (default: --output-len)")
    load.add_argument("--turns", type=int, default=d.turns,
                      help="each arrival is a conversation of this many turns; a turn is sent once the previous "
                           "answer is complete, with the whole history plus a new user message (default 1)")
    load.add_argument("--turn-prompt-len", help="the new user message's length in turns 2.. (default: --prompt-len)")
    load.add_argument("--seed", type=int, default=d.seed, help="same seed, same requests (default 0)")
    load.add_argument("--id-salt", type=int, default=d.id_salt,
                      help="relabel the token ids by a permutation drawn from (seed, salt): same lengths and times, "
                           "no prefix shared with another salt's prompts (default 0: none)")
    load.add_argument("--distinct-ids", action="store_true",
                      help="with --compare: the i-th deployment's ids get salt --id-salt + i + 1, so deployments "
                           "that share servers find none of each other's prompts in a prefix cache")
    out = p.add_argument_group("measure and report")
    out.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT limit in ms")
    out.add_argument("--slo-itl-ms", type=float, help="goodput: TPOT limit in ms (vLLM's definition)")
    out.add_argument("--slo-itl-p99-ms", type=float,
                     help="per-token goodput: limit in ms on the P99 of each request's own inter-token gaps")
    out.add_argument("--slo-itl-max-ms", type=float,
                     help="per-token goodput: limit in ms on each request's longest inter-token gap")
    out.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline per request, s (300)")
    out.add_argument("--no-warmup", action="store_true", help="skip the one short request per server first")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--json", metavar="PATH", help="write the summary (and parameters) as JSON")
    out.add_argument("--json-details", action="store_true", help="add every request's record to --json")
    out.add_argument("--plot", metavar="PATH", help="PNG: ITL over time, TTFT against prompt length")
    return p


def split_targets(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(t.strip() for v in values for t in v.split(",") if t.strip())


def api_for(targets: tuple[str, ...], api: str) -> str:
    return "openai" if targets and all("://" in t for t in targets) else api


def parse_compare(item: str, default_targets: tuple[str, ...], mode: str | None, chunk: int,
                  api: str = "grpc") -> Deployment:
    match = COMPARE.match(item.strip())
    if not match:
        raise ValueError(f"bad --compare item {item!r}: use NAME=TARGETS[@MODE[:CHUNK]]")
    targets = split_targets([match["targets"]]) or default_targets
    if not targets:
        raise ValueError(f"--compare {item!r} names no targets and no --target was given")
    if match["mode"] is not None and match["mode"] not in MODES:
        raise ValueError(f"--compare {item!r}: mode must be one of {', '.join(MODES)}")
    mode = match["mode"] or mode
    size = int(match["chunk"] or 0)
    if mode == "partitioned":
        return Deployment(match["name"], targets, mode, chunk, prefill_sms=size, api=api_for(targets, api))
    return Deployment(match["name"], targets, mode, size or chunk, api=api_for(targets, api))


def json_object(text: str) -> str:
    try:
        ok = isinstance(json.loads(text), dict)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return text


def deployments(args: argparse.Namespace) -> list[Deployment]:
    targets = split_targets(args.target)
    if not args.compare:
        if not targets:
            raise ValueError("give --target HOST:PORT (or --compare)")
        return [Deployment(args.mode or "load", targets, args.mode, args.chunk_size, api=api_for(targets, args.api),
                           extra_body=args.openai_extra_body or "")]
    runs = [parse_compare(item, targets, args.mode, args.chunk_size, args.api) for item in args.compare]
    if args.openai_extra_body:
        runs = [dataclasses.replace(r, extra_body=args.openai_extra_body) if r.api == "openai" else r for r in runs]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare names must differ: {names}")
    return runs


def load_spec(args: argparse.Namespace) -> LoadSpec:
    return LoadSpec(args.rate, args.duration, args.prompt_len, args.output_len, args.long_prompt_frac,
                    args.long_prompt_len, args.background_users, args.background_prompt_len,
                    args.background_output_len, args.seed, args.turns, args.turn_prompt_len, args.id_salt)


async def run_deployments(spec: LoadSpec, runs: Sequence[Deployment], timeout_s: float, tls_ca: str | None = None,
                          warmup: bool = True, progress: bool = True, distinct_ids: bool = False) -> list[RunResult]:
    """The async entry: the same plan (rebuilt, so background users restart too) against each deployment in turn;
    with `distinct_ids` each deployment's token ids are relabelled by a salt of its own."""
    results = []
    for i, deployment in enumerate(runs):
        print(f"== {deployment.name}: {deployment.describe()}", file=sys.stderr)
        own = dataclasses.replace(spec, id_salt=spec.id_salt + i + 1) if distinct_ids else spec
        runner = LoadRunner(build_plan(own), deployment, timeout_s, tls_ca, progress)
        results.append(await runner.run(warmup=warmup))
    return results


def report(args: argparse.Namespace, argv: Sequence[str], spec: LoadSpec, slo: Slo,
           results: Sequence[RunResult], summaries: Sequence[Summary]) -> dict[str, Any]:
    params = {**vars(spec), "planned_arrivals": len(build_plan(spec).arrivals), "slo_ttft_ms": slo.ttft_ms,
              "slo_itl_ms": slo.itl_ms, "slo_itl_p99_ms": slo.itl_p99_ms,
              "slo_itl_max_ms": slo.itl_max_ms,
              "request_timeout_s": args.request_timeout,
              "distinct_ids": bool(args.distinct_ids and args.compare)}
    runs = {}
    for result, summary in zip(results, summaries, strict=True):
        runs[summary["name"]] = dict(summary)
        if args.json_details:
            runs[summary["name"]]["requests"] = [record_details(r) for r in result.records]
    meta = {"params": params, "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "client.load", *argv]), "commit": git_commit()}
    if args.compare:
        return {"runs": runs, **meta}
    return {**next(iter(runs.values())), **meta}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        spec, runs = load_spec(args), deployments(args)
    except ValueError as e:
        parser.error(str(e))
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_itl_p99_ms, args.slo_itl_max_ms)
    try:
        results = run_event_loop(run_deployments(spec, runs, args.request_timeout, args.tls_ca,
                                                 warmup=not args.no_warmup, progress=not args.no_progress,
                                                 distinct_ids=args.distinct_ids and bool(args.compare)))
    except KeyboardInterrupt:
        print("interrupted: no summary", file=sys.stderr)
        return 130
    summaries = [summarize(r, slo) for r in results]
    print(format_side_by_side(summaries, slo) if args.compare else format_summary(summaries[0], slo))
    if args.json:
        Path(args.json).write_text(json.dumps(report(args, argv, spec, slo, results, summaries), indent=2) + "\n")
    if args.plot:
        from client.load_plot import plot_runs

        plot_runs(results, args.plot)
    return 0 if any(s["completed"] for s in summaries) else 1  # 1: nothing at all got through


if __name__ == "__main__":
    sys.exit(main())
