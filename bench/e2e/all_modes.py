"""`python -m bench.e2e.all_modes`: start a prefill and a decode server, replay the scenario against
them (client.scenario), and record the result with date, hardware, commit and command.

With several `--kv-transport`s the pair is started once per transport and every row of the one
JSON names the `kv_transport` it ran over."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import metadata, write_json
from launcher.process import ServerFailed, ServerProcess, stop_all


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.all_modes", description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--prefill-device", default="auto")
    p.add_argument("--decode-device", default="auto")
    p.add_argument("--kv-transport", nargs="+", default=["auto"],
                   help="one or more of grpc, nccl, cuda-ipc, nixl, auto; each gets its own pair of servers")
    p.add_argument("--decode-args", default="", help="extra decode server flags")
    p.add_argument("--prefill-args", default="", help="extra prefill server flags")
    p.add_argument("--scenario-args", default="--b-len 16384 32768", help="client.scenario flags")
    p.add_argument("--json", default="bench/results/scenario-h200.json")
    p.add_argument("--plot", default=None, help="PNG of A's gaps (one per transport, suffixed, with several)")
    p.add_argument("--logs", default=None, help="folder for the servers' logs")
    args = p.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp())
    several = len(args.kv_transport) > 1
    rows: list[dict[str, Any]] = []
    commands: list[str] = []
    for transport in args.kv_transport:
        plot = args.plot and (str(Path(args.plot).with_stem(f"{Path(args.plot).stem}-{transport}")) if several
                              else args.plot)
        doc = run_pair(args, transport, logs / transport if several else logs, plot)
        rows += [{**row, "kv_transport": transport} for row in doc["rows"]]
        commands.append(doc["scenario_command"])
    write_json(args.json, {**doc, "rows": rows, **metadata(), "kv_transport": args.kv_transport,
                           "preset": args.preset, "prefill_device": args.prefill_device,
                           "decode_device": args.decode_device, "decode_args": args.decode_args,
                           "scenario_command": commands[0] if not several else commands})
    print(f"wrote {args.json}")


def run_pair(args: argparse.Namespace, transport: str, logs: Path, plot: str | None) -> dict[str, Any]:
    """Start the pair with KV over `transport`, replay the scenario, stop the pair; the scenario's JSON."""
    logs.mkdir(parents=True, exist_ok=True)
    # No prefix cache: every row sends the same B, which must be prefilled, not found in a cache.
    common = ["--host", "127.0.0.1", "--preset", args.preset, "--kv-transport", transport, "--metrics-port",
              "0", "--no-prefix-cache"]
    prefill = ServerProcess("prefill_server", [*common, "--port", "50052", "--device", args.prefill_device,
                                               *args.prefill_args.split()], "127.0.0.1:50052", logs / "prefill.log")
    decode = ServerProcess("decode_server", [*common, "--port", "50051", "--http-port", "0",
                                             "--device", args.decode_device, "--prefill-addr", prefill.address,
                                             *args.decode_args.split()],
                           "127.0.0.1:50051", logs / "decode.log")
    try:  # one after the other: on a shared GPU, the decode server sizes its KV pool from what the prefill left
        prefill.start(timeout=900)
        decode.start(timeout=900)
        out = logs / "scenario.json"
        cmd = [sys.executable, "-m", "client.scenario", "--target", "127.0.0.1:50051", "--json", str(out),
               *(["--plot", plot] if plot else []), *args.scenario_args.split()]
        if subprocess.run(cmd).returncode != 0:
            sys.exit("error: the scenario failed; server logs in " + str(logs))
        doc: dict[str, Any] = json.loads(out.read_text())
        return {**doc, "scenario_command": " ".join(cmd[2:])}
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        stop_all([decode, prefill], timeout=60)


if __name__ == "__main__":
    main()
