"""`python -m bench.e2e.partitioned_gaps`: where partitioned mode's slow gaps come from.

One decode server per variant (its extra flags, e.g. "--gil-switch-ms 0.5"), started once with
`--step-trace`; the scenario's `alone` and `partitioned` rows replayed `--runs` times against it
(client.scenario, B = `--b-len`). Each run's partitioned row gives A's slow gaps and worst gap; the
trace gives, for every slow step of the server (a gap between two steps' tokens longer than twice
the median step alone), what it was made of:
- `gpu`: the step's own kernels took most of the gap (the prefill beside it held the device);
- `launch`: queueing the step on the host took over 1 ms (the engine thread waited inside it);
- `host`: neither: the engine thread started the step, or read its tokens, late;
and where it fell in the prefill (`while_queueing`: before the prefill thread had queued its last
layer). The target: every run with 0 slow gaps and a worst gap within 2x A's median alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import metadata, write_json
from client.load_stats import distribution_ms
from decode_server.step_trace import read_trace
from launcher.process import ServerFailed, ServerProcess, stop_all

LAUNCH_SLOW_S = 1e-3


def classify(steps: list[dict[str, Any]], prefills: list[dict[str, Any]]) -> dict[str, Any]:
    """The slow steps of a trace inside its partitioned prefills, each with its make-up."""
    windows = [(p["start_s"], p["end_s"], p["queued_s"]) for p in prefills]

    def window_of(t: float) -> tuple[float, float, float] | None:
        return next((w for w in windows if w[0] <= t <= w[1] + 0.02), None)

    # a gap between two steps that share a request: an idle engine between two requests is no gap of anyone's
    gaps = [(b, b["tokens_s"] - a["tokens_s"]) for a, b in zip(steps, steps[1:], strict=False)
            if set(a["requests"]) & set(b["requests"])]
    alone = [g for s, g in gaps if window_of(s["tokens_s"]) is None and s["batch"] == 1]
    median_alone = statistics.median(alone) if alone else None
    slow: list[dict[str, Any]] = []
    inside = 0
    for step, gap in gaps:
        window = window_of(step["tokens_s"])
        if window is None or median_alone is None:
            continue
        inside += 1
        if gap <= 2 * median_alone:
            continue
        gpu_s = (step["gpu_ms"] or 0.0) / 1e3
        launch_s = step["launched_s"] - step["launch_s"]
        kind = "gpu" if gpu_s >= 0.75 * gap else "launch" if launch_s > LAUNCH_SLOW_S else "host"
        slow.append({"gap_ms": round(gap * 1e3, 3), "gpu_ms": round(gpu_s * 1e3, 3),
                     "launch_ms": round(launch_s * 1e3, 3), "kind": kind,
                     "since_prefill_start_ms": round((step["tokens_s"] - window[0]) * 1e3, 1),
                     "while_queueing": step["tokens_s"] <= window[2]})
    return {"median_step_alone_ms": round(median_alone * 1e3, 3) if median_alone else None,
            "steps_beside_prefills": inside, "slow_steps": slow,
            "slow_by_kind": {k: sum(s["kind"] == k for s in slow) for k in ("gpu", "launch", "host")},
            "gpu_ms_beside_prefills": distribution_ms([s["gpu_ms"] / 1e3 for s in steps if s["gpu_ms"] is not None
                                                       and window_of(s["tokens_s"]) is not None])}


def run_variant(args: argparse.Namespace, name: str, extra: list[str], logs: Path) -> dict[str, Any]:
    trace = logs / f"{name}-steps.jsonl"
    server = ServerProcess("decode_server", ["--host", "127.0.0.1", "--port", str(args.port), "--metrics-port", "0",
                                             "--http-port", "0", "--preset", args.preset, "--no-prefix-cache",
                                             "--step-trace", str(trace), *extra],
                           f"127.0.0.1:{args.port}", logs / f"{name}-decode.log")
    runs = []
    try:
        server.start(timeout=600)
        for k in range(args.runs):
            out = logs / f"{name}-run{k}.json"
            cmd = [sys.executable, "-m", "client.scenario", "--target", server.address, "--b-len", str(args.b_len),
                   "--modes", "alone,partitioned", "--json", str(out)]
            if subprocess.run(cmd).returncode != 0:
                raise RuntimeError(f"client.scenario failed in run {k}; see {server.log_path}")
            rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
            alone, part = rows["alone"], rows["partitioned"]
            runs.append({"a_median_gap_alone_ms": round(alone["a_median_gap_ms"], 3),
                         "a_median_gap_ms": round(part["a_median_gap_ms"], 3),
                         "a_worst_gap_ms": round(part["a_worst_gap_ms"], 3), "a_slow_gaps": part["a_slow_gaps"],
                         "worst_over_alone": round(part["a_worst_gap_ms"] / alone["a_median_gap_ms"], 3),
                         "b_ttft_ms": round(part["b_ttft_ms"], 1), "prefill_sms": part.get("prefill_sms"),
                         "tokens_identical": bool(part["a_tokens_match_solo"] and part["b_first_token_matches"])})
    finally:
        stop_all([server], timeout=60)
    steps, prefills = read_trace(trace)
    clean = [r["a_slow_gaps"] == 0 and r["worst_over_alone"] <= 2.0 for r in runs]
    return {"server_args": extra, "runs": runs, "clean_runs": sum(clean), "trace": classify(steps, prefills)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.partitioned_gaps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--b-len", type=int, default=32768)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--port", type=int, default=50081)
    p.add_argument("--variant", nargs="+", default=["default="], metavar="NAME=FLAGS",
                   help='decode servers to compare, e.g. default= gil=\'--gil-switch-ms 0.5\' (default: %(default)s)')
    p.add_argument("--json", default="bench/results/scenario-partitioned-h200.json")
    p.add_argument("--logs", default=None)
    args = p.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    variants: dict[str, Any] = {}
    try:
        for item in args.variant:
            name, _, flags = item.partition("=")
            variants[name] = run_variant(args, name, flags.split(), logs)
            print(f"{name}: {variants[name]['clean_runs']}/{args.runs} clean runs; slow steps by kind "
                  f"{variants[name]['trace']['slow_by_kind']}", flush=True)
            write_json(args.json, {**metadata(), "preset": args.preset, "b_len": args.b_len, "variants": variants})
    except (ServerFailed, RuntimeError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
