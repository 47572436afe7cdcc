"""`python -m bench.e2e.http_vs_grpc`: what the OpenAI HTTP API (SSE) costs per token against gRPC.

One decode server (colocated), its gRPC port and its HTTP port; client.load sends the same seeded
load to each in turn: --users users decoding back to back (a batch of that many), each request a
--prompt-len prompt and --output-len tokens. Records the inter-token latency (ITL) median, p99 and
mean of each API and their differences, with date, hardware, commit and command. The budget: SSE
adds at most 0.2 ms a token over gRPC.

    python -m bench.e2e.http_vs_grpc                                   # one H200: qwen2.5-7b, batch 64
    python -m bench.e2e.http_vs_grpc --preset tiny --device cpu --users 64 --duration 10 --prompt-len 32 \\
        --output-len 32 --json /tmp/http-cpu.json          # anywhere, as a check that it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import metadata, write_json
from launcher.process import ServerFailed, ServerProcess

BUDGET_MS = 0.2  # what SSE may add to a token's gap over gRPC


def overhead(grpc_itl: dict[str, Any], http_itl: dict[str, Any]) -> dict[str, float | None]:
    """HTTP's ITL less gRPC's, per statistic (ms)."""
    return {k: None if grpc_itl.get(k) is None or http_itl.get(k) is None else round(http_itl[k] - grpc_itl[k], 3)
            for k in ("mean", "p50", "p99")}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.http_vs_grpc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of --preset (its tokenizer then "
                                                 "detokenizes every token, over both APIs)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--users", type=int, default=64, help="users decoding back to back: the batch (default 64)")
    p.add_argument("--prompt-len", default="512")
    p.add_argument("--output-len", default="256")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load each way (default 60)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--port", type=int, default=50081, help="gRPC port; HTTP on --http-port")
    p.add_argument("--http-port", type=int, default=8081)
    p.add_argument("--server-args", default="", help="extra decode server flags")
    p.add_argument("--extra-body", default="", help="a JSON object of fields added to every HTTP request "
                   "(logprobs, penalties, ...): their cost shows as HTTP's ITL over gRPC's")
    p.add_argument("--json", default="bench/results/http-h200.json")
    p.add_argument("--logs", default=None)
    args = p.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    server_args = ["--host", "127.0.0.1", "--port", str(args.port), "--http-port", str(args.http_port),
                   "--metrics-port", "0", *(["--model", args.model] if args.model else ["--preset", args.preset]),
                   "--device", args.device, "--mode", "colocated",
                   "--no-prefix-cache",  # both APIs send the same seeded prompts, one after the other
                   "--max-batch-size", str(args.users), *args.server_args.split()]
    server = ServerProcess("decode_server", server_args, f"127.0.0.1:{args.port}", logs / "decode_server.log")
    out = logs / "load.json"
    load_args = ["--rate", "0", "--background-users", str(args.users), "--duration", str(args.duration),
                 "--prompt-len", args.prompt_len, "--output-len", args.output_len, "--seed", str(args.seed),
                 *(["--openai-extra-body", args.extra_body] if args.extra_body else [])]
    cmd = [sys.executable, "-m", "client.load", "--no-progress", "--json", str(out), *load_args, "--compare",
           f"grpc=127.0.0.1:{args.port}", f"http=http://127.0.0.1:{args.http_port}/v1"]
    try:
        server.start(timeout=900)
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"error: the load run failed; the server's log is {server.log_path}")
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        server.stop(timeout=60)
    runs = json.loads(out.read_text())["runs"]
    grpc_itl, http_itl = runs["grpc"]["itl_ms"], runs["http"]["itl_ms"]
    added = overhead(grpc_itl, http_itl)
    doc = {**metadata(), "model": args.model or f"preset:{args.preset}", "device": args.device,
           "server": f"python -m decode_server {' '.join(server_args)}", "load_command": " ".join(cmd[2:]),
           "extra_body": args.extra_body or None,
           "itl_ms": {"grpc": grpc_itl, "http": http_itl}, "http_minus_grpc_ms": added, "budget_ms": BUDGET_MS,
           "within_budget": added["p50"] is not None and added["p50"] <= BUDGET_MS,
           "runs": runs}
    write_json(args.json, doc)
    print(f"ITL ms  gRPC p50 {grpc_itl['p50']} p99 {grpc_itl['p99']} | HTTP p50 {http_itl['p50']} p99 "
          f"{http_itl['p99']} | HTTP - gRPC p50 {added['p50']} (budget {BUDGET_MS}); wrote {args.json}")


if __name__ == "__main__":
    main()
