"""`python -m bench.scenario`: start a prefill and a decode server, replay the scenario against
them (client.scenario), and record the result with date, hardware, commit and command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import metadata, write_json
from client.wait_ready import is_serving


def start(module: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen[bytes], address: str, log: Path, timeout: float = 900) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: server for {address} exited:\n{log.read_text()[-3000:]}")
        if is_serving(address):
            return
        time.sleep(0.5)
    sys.exit(f"error: {address} not ready after {timeout}s")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scenario", description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--prefill-device", default="auto")
    p.add_argument("--decode-device", default="auto")
    p.add_argument("--kv-transport", default="auto")
    p.add_argument("--decode-args", default="", help="extra decode server flags")
    p.add_argument("--prefill-args", default="", help="extra prefill server flags")
    p.add_argument("--scenario-args", default="--b-len 16384 32768", help="client.scenario flags")
    p.add_argument("--json", default="bench/results/scenario-h200.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--logs", default=None, help="folder for the servers' logs")
    args = p.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    common = ["--host", "127.0.0.1", "--preset", args.preset, "--kv-transport", args.kv_transport]
    prefill = start("prefill_server", [*common, "--port", "50052", "--metrics-port", "0", "--device",
                                       args.prefill_device, *args.prefill_args.split()], logs / "prefill.log", env)
    decode = None
    try:
        wait_ready(prefill, "127.0.0.1:50052", logs / "prefill.log")
        decode = start("decode_server", [*common, "--port", "50051", "--metrics-port", "0", "--device",
                                         args.decode_device, "--prefill-addr", "127.0.0.1:50052",
                                         *args.decode_args.split()], logs / "decode.log", env)
        wait_ready(decode, "127.0.0.1:50051", logs / "decode.log")
        out = logs / "scenario.json"
        cmd = [sys.executable, "-m", "client.scenario", "--target", "127.0.0.1:50051", "--json", str(out),
               *(["--plot", args.plot] if args.plot else []), *args.scenario_args.split()]
        if subprocess.run(cmd, env=env).returncode != 0:
            sys.exit("error: the scenario failed; server logs in " + str(logs))
        doc = json.loads(out.read_text())
        doc.update({**metadata(), "kv_transport": args.kv_transport, "preset": args.preset,
                    "prefill_device": args.prefill_device, "decode_device": args.decode_device,
                    "decode_args": args.decode_args, "scenario_command": " ".join(cmd[2:])})
        write_json(args.json, doc)
        print(f"wrote {args.json}")
    finally:
        for proc in (decode, prefill):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
