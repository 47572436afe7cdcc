"""`python -m bench.headline` (`make results`): re-measure every table the README shows on the GPUs
present, record each in bench/results, and render the tables anew (bench.readme_tables).

One H200: the engine (decode steps and prefills against their floors) with bf16 weights and with FP8
weights and KV, the A/B scenario at B = 32k in every mode with both servers on the GPU, and the
many-user load in every local mode; within one 10-minute call (each run is stopped at its budget;
they took 25-35 s, 62 s and 141 s when last timed). Two GPUs add the split pair's scenario and load
sweep. Each file keeps the runs it replaces under `previous`, and gets the card's held HBM copy and
sustained bf16 matmul rates from this call's engine run, so figures from different cards can be told
apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import history, readme_tables

RESULTS = history.RESULTS
STOP_S = 60  # how long a run stopped at its budget may take to stop its servers
SCENARIO_MODES = "alone,disaggregated,colocated,chunked:512,chunked:2048,layered,partitioned:72"
LOAD = ("--rate 2 --duration 20 --prompt-len uniform:512:2048 --output-len 128 --background-users 16 "
        "--long-prompt-frac 0.15 --long-prompt-len 16384 --slo-ttft-ms 3000 --slo-itl-ms 50 --slo-itl-p99-ms 50 "
        "--seed 7")
LOAD_2X = ("--duration 20 --prompt-len uniform:512:2048 --output-len 128 --background-users 16 "
           "--long-prompt-frac 0.15 --long-prompt-len 16384 --turns 3 --turn-prompt-len uniform:64:256 "
           "--slo-ttft-ms 3000 --slo-itl-ms 50 --slo-itl-p99-ms 50 --seed 7")


@dataclass(frozen=True)
class Measurement:
    name: str  # the results file's stem
    gpus: int  # how many GPUs it needs
    args: list[str]  # after `python -m`, without --json
    budget_s: int  # what it may take before it is stopped

    @property
    def file(self) -> Path:
        return RESULTS / f"{self.name}.json"


ENGINE_STEPS = ["--batches", "1", "8", "32", "64", "--prefill-lens", "4096", "32768"]  # both engine tables
MEASUREMENTS = (
    Measurement("engine-h200", 1, ["bench.micro.engine_steps", *ENGINE_STEPS], 100),
    Measurement("engine-fp8-kv-fp8-h200", 1, ["bench.micro.engine_steps", "--preset", "qwen2.5-7b-fp8",
                                              "--kv-cache-dtype", "fp8", *ENGINE_STEPS], 100),
    Measurement("scenario-h200", 1, ["bench.e2e.all_modes", "--kv-transport", "cuda-ipc", "--scenario-args",
                                     f"--b-len 32768 --modes {SCENARIO_MODES}"], 160),
    Measurement("load-h200", 1, ["bench.e2e.deployments", "--devices", "cuda:0", "--server-args", "--prefill-sms 72",
                                 "--load-args", LOAD], 220),
    Measurement("scenario-2xh200", 2, ["bench.e2e.all_modes", "--prefill-device", "cuda:0",
                                       "--decode-device", "cuda:1",
                                       "--kv-transport", "nccl", "cuda-ipc", "--scenario-args",
                                       "--b-len 32768 --modes alone,disaggregated,colocated,chunked:512,"
                                       "chunked:2048,layered"], 300),
    Measurement("load-2xh200", 2, ["bench.e2e.deployments", "--devices", "cuda:0", "cuda:1", "--kv-transport", "nccl",
                                   "--load-args", LOAD_2X, "--rates", "2", "4", "8", "--only", "auto", "split",
                                   "colocated", "layered", "partitioned"], 600),
)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def with_history(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """`new` with `old`, and all its own history, under `previous`: the planner and the renderer read
    runs older than the newest (a decode profile, a mode the newest run left out)."""
    return {**{k: v for k, v in new.items() if k != "previous"}, **({"previous": old} if old else {})}


def measure(m: Measurement, card: dict[str, float] | None, logs: Path) -> bool:
    """Run one measurement into its file (keeping the run before it); False if it failed or ran out of time."""
    old = json.loads(m.file.read_text()) if m.file.exists() else None
    out = logs / f"{m.name}.json"
    cmd = [sys.executable, "-m", *m.args, "--json", str(out)]
    print(f"[headline] {m.name}: python -m {' '.join(m.args)}", flush=True)
    start = time.monotonic()
    # a process group of its own: a run stopped at its budget takes the servers it started with it
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=m.budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the servers drain and stop, as on any SIGTERM
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print(f"[headline] {m.name}: stopped after {m.budget_s} s; its file is left as it was", flush=True)
        return False
    print(f"[headline] {m.name}: {'done' if code == 0 else 'failed'} in {time.monotonic() - start:.0f} s",
          flush=True)
    if code != 0 or not out.exists():
        return False
    new = json.loads(out.read_text())
    new["command"] = shlex.join(["python", "-m", *m.args, "--json", str(m.file)])
    new["measured_by"] = "python -m bench.headline"
    if card:
        new["card"] = card
    m.file.write_text(json.dumps(with_history(new, old), indent=1) + "\n")
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=[m.name for m in MEASUREMENTS], help="these measurements alone")
    p.add_argument("--logs", default="run/headline", help="the runs' own outputs (default: %(default)s)")
    args = p.parse_args(argv)
    gpus = gpu_count()
    chosen = [m for m in MEASUREMENTS if m.gpus <= gpus and (not args.only or m.name in args.only)]
    if not chosen:
        sys.exit(f"error: no measurement runs on {gpus} GPU(s); the README's tables need one or two CUDA GPUs")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    card = None
    failed = []
    for m in chosen:
        if not measure(m, card, logs):
            failed.append(m.name)
        elif m.name == "engine-h200":
            engine = json.loads(m.file.read_text())
            card = {"hbm_gbps": engine["hbm_gbps_measured"], "bf16_tflops_sustained": engine["bf16_tflops_sustained"]}
    # the simulator's costs are fitted to these files; docs/scaling.md renders them from its record
    subprocess.run([sys.executable, "-m", "planner", "--costs"], check=True)
    readme_tables.main([])
    if failed:
        sys.exit(f"error: {', '.join(failed)} did not finish; their files and tables are as they were")


if __name__ == "__main__":
    main()
