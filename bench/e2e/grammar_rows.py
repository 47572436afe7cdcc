"""`python -m bench.e2e.grammar_rows`: what rows under a grammar cost the batch they decode in.

One decode server (colocated) over HTTP. First --users users decode back to back with no grammar (a
batch of that many); then, against the same server, --users minus --grammar-users of them as before
while --grammar-users others send every request with --grammar-body (a JSON-schema response_format
by default), at the same time, from a second load process. Each step decodes every row, so the
unconstrained users' inter-token latency (ITL) in the mixed batch is what the grammar rows cost the
others; the target is within 10% of the batch without grammars. Records both runs' ITL, the grammar
rows' own, their output lengths (a grammar can end a row early), with date, hardware, commit and
command.

    python -m bench.e2e.grammar_rows                                   # one H200: qwen2.5-7b, 64 rows, 8 constrained
    python -m bench.e2e.grammar_rows --preset tiny --device cpu --users 8 --grammar-users 2 --duration 5 \\
        --prompt-len 32 --output-len 32 --json /tmp/grammar-cpu.json    # anywhere, as a check that it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import metadata, tokenizer_args, write_json
from launcher.process import ServerFailed, ServerProcess

TARGET_RATIO = 1.10  # the mixed batch's ITL over the unconstrained batch's
# the load sends ignore_eos, which a grammar's end refuses: a constrained row ends when its JSON does
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
          "required": ["answer", "score"]}
JSON_SCHEMA = {"ignore_eos": False,
               "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}


def load_cmd(url: str, users: int, args: argparse.Namespace, out: Path, seed: int, extra_body: str = "") -> list[str]:
    return [sys.executable, "-m", "client.load", "--no-progress", "--api", "openai", "--target", url,
            "--rate", "0", "--background-users", str(users), "--duration", str(args.duration),
            "--prompt-len", args.prompt_len, "--output-len", args.output_len, "--seed", str(seed),
            "--json", str(out), *(["--openai-extra-body", extra_body] if extra_body else [])]


def only_run(path: Path) -> dict[str, Any]:
    """client.load's summary of its one run (a run without --compare is the document itself)."""
    doc = json.loads(path.read_text())
    return {k: v for k, v in doc.items() if k not in ("params", "date", "command", "commit")}


def ratio(mixed: dict[str, Any], alone: dict[str, Any], key: str) -> float | None:
    return round(mixed[key] / alone[key], 3) if mixed.get(key) and alone.get(key) else None


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.grammar_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--users", type=int, default=64, help="rows decoding together (default 64)")
    p.add_argument("--grammar-users", type=int, default=8, help="of them, rows under the grammar (default 8)")
    p.add_argument("--grammar-body", default=json.dumps(JSON_SCHEMA),
                   help="the JSON fields a constrained row's request adds (default: a JSON-schema response_format)")
    p.add_argument("--prompt-len", default="512")
    p.add_argument("--output-len", default="256")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load each run (default 30)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--port", type=int, default=50083, help="gRPC port (health); HTTP on --http-port")
    p.add_argument("--http-port", type=int, default=8083)
    p.add_argument("--server-args", default="", help="extra decode server flags")
    p.add_argument("--json", default="bench/results/grammar-rows-h200.json")
    p.add_argument("--logs", default=None)
    args = p.parse_args()
    if not 0 < args.grammar_users < args.users:
        sys.exit("error: --grammar-users must be between 1 and --users - 1")
    logs = Path(args.logs or tempfile.mkdtemp())
    logs.mkdir(parents=True, exist_ok=True)
    server_args = ["--host", "127.0.0.1", "--port", str(args.port), "--http-port", str(args.http_port),
                   "--metrics-port", "0", "--preset", args.preset, "--device", args.device, "--mode", "colocated",
                   "--no-prefix-cache", "--max-batch-size", str(args.users), *tokenizer_args(args.preset),
                   *args.server_args.split()]
    server = ServerProcess("decode_server", server_args, f"127.0.0.1:{args.port}", logs / "decode_server.log")
    url = f"http://127.0.0.1:{args.http_port}/v1"
    alone_cmd = load_cmd(url, args.users, args, logs / "alone.json", args.seed)
    free_cmd = load_cmd(url, args.users - args.grammar_users, args, logs / "free.json", args.seed)
    grammar_cmd = load_cmd(url, args.grammar_users, args, logs / "grammar.json", args.seed + 1, args.grammar_body)
    try:
        server.start(timeout=900)
        if subprocess.run(alone_cmd).returncode != 0:
            sys.exit(f"error: the unconstrained run failed; the server's log is {server.log_path}")
        constrained = subprocess.Popen(grammar_cmd)
        free_rc = subprocess.run(free_cmd).returncode
        if constrained.wait() != 0 or free_rc != 0:
            sys.exit(f"error: the mixed run failed; the server's log is {server.log_path}")
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        server.stop(timeout=60)
    alone, free, grammar = (only_run(logs / f"{n}.json") for n in ("alone", "free", "grammar"))
    ratios = {k: ratio(free["itl_ms"], alone["itl_ms"], k) for k in ("mean", "p50", "p99")}
    doc = {**metadata(), "model": f"preset:{args.preset}", "device": args.device,
           "server": f"python -m decode_server {' '.join(server_args)}", "grammar_body": json.loads(args.grammar_body),
           "users": args.users, "grammar_users": args.grammar_users,
           "itl_ms": {"unconstrained_batch": alone["itl_ms"], "mixed_unconstrained_rows": free["itl_ms"],
                      "mixed_grammar_rows": grammar["itl_ms"]},
           "mixed_over_unconstrained": ratios, "target_ratio": TARGET_RATIO,
           "within_target": ratios["mean"] is not None and ratios["mean"] <= TARGET_RATIO,
           "grammar_rows_mean_output_tokens": round(grammar["output_tokens"] / max(grammar["completed"], 1), 1),
           "runs": {"unconstrained_batch": alone, "mixed_unconstrained_rows": free, "mixed_grammar_rows": grammar}}
    write_json(args.json, doc)
    print(f"ITL ms  no grammar: p50 {alone['itl_ms']['p50']} mean {alone['itl_ms']['mean']} | "
          f"{args.grammar_users} of {args.users} rows under a grammar: the others p50 {free['itl_ms']['p50']} "
          f"mean {free['itl_ms']['mean']}, the grammar rows p50 {grammar['itl_ms']['p50']} | ratio of means "
          f"{ratios['mean']} (target <= {TARGET_RATIO}); wrote {args.json}")


if __name__ == "__main__":
    main()
