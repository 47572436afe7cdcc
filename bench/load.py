"""`python -m bench.load`: the same seeded many-user load against one decode server per GPU,
colocated against chunked (client.load --compare), recorded with date, hardware, commit and command.
With one GPU there is one server and the mode is sent per request."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import metadata, write_json
from bench.scenario import start, wait_ready

LOAD = ("--rate 2 --duration 30 --prompt-len uniform:512:2048 --output-len 128 --background-users 16 "
        "--long-prompt-frac 0.15 --long-prompt-len 16384 --slo-ttft-ms 3000 --slo-itl-ms 50 --seed 7")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--load-args", default=LOAD, help="client.load flags (default: %(default)s)")
    p.add_argument("--compare", nargs="+", default=["colocated=@colocated", "chunked-512=@chunked:512",
                                                      "chunked-2048=@chunked:2048"])
    p.add_argument("--json", default="bench/results/load-h200.json")
    p.add_argument("--logs", default=None)
    args = p.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = start("decode_server", ["--host", "127.0.0.1", "--port", "50071", "--metrics-port", "0", "--preset",
                                     args.preset, "--device", args.device, "--mode", "colocated"],
                   logs / "decode.log", env)
    try:
        wait_ready(server, "127.0.0.1:50071", logs / "decode.log")
        out = logs / "load.json"
        cmd = [sys.executable, "-m", "client.load", "--target", "127.0.0.1:50071", "--no-progress", "--json",
               str(out), *args.load_args.split(), "--compare", *args.compare]
        if subprocess.run(cmd, env=env).returncode != 0:
            sys.exit("error: the load run failed; server log in " + str(logs))
        doc = json.loads(out.read_text())
        doc.update({**metadata(), "preset": args.preset, "deployment": "one decode server on one GPU, no prefill "
                    "server; prefill_mode sent per request", "load_command": " ".join(cmd[2:])})
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    main()
