"""`python -m bench.e2e.hostile_bodies`: how long a hostile HTTP body holds other users' tokens.

One decode server (colocated) streams a long answer over its OpenAI API to one user; meanwhile
other clients send bodies built to cost the server work: one larger than the body limit, one at the
limit of a million small JSON values (an id list, a chat of empty messages), a prompt of ids past
the context, a text prompt past it (also truncated to 16 tokens, and to /tokenize), a Responses API
input to render past it, a gzip bomb; and, as a baseline, an ordinary 16-token prompt (a request
that is answered costs the stream its prefill and steps beside it, as in any colocated server).
Each is sent --trials times; for each trial the longest gap between the streamed tokens while it was
answered is recorded beside the longest gap of an idle window just before, and the stall is their
difference. The target: at most 10 ms beyond what the baseline costs.
--gil-switch-ms runs them all again against a server started with each switch interval: a thread
that renders or parses holds the GIL in slices that long, and the engine thread waits up to one
slice at every call into torch.

    python -m bench.e2e.hostile_bodies                       # one H200: qwen2.5-7b
    python -m bench.e2e.hostile_bodies --preset tiny --device cpu --json bench/results/hostile-bodies-cpu.json
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import metadata, tokenizer_args, write_json
from decode_server.http_request import default_max_body_bytes
from launcher.process import ServerFailed, ServerProcess

TARGET_MS = 10.0
WINDOW_S = 1.0  # the idle window before each body, and at least this long after it was sent


def bodies(limit: int, max_model_len: int) -> dict[str, tuple[str, bytes, dict[str, str]]]:
    """Case name -> (path, body, headers); every body is built here, before any is timed."""
    values = (limit - 64) // 2  # "1," a value
    ids = b'{"max_tokens": 2, "prompt": [' + b",".join([b"1"] * values) + b"]}"
    message = b'{"role":"user","content":""}'
    chat = b'{"max_tokens": 2, "messages": [' + b",".join([message] * ((limit - 64) // (len(message) + 1))) + b"]}"
    # as many messages as the value count lets through (3 values each), each as long as the body allows
    count = max_model_len // 3
    filler = "a" * max(1, (limit - 4096) // count - 40)
    rendered = json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": filler}] * count},
                          separators=(",", ":")).encode()
    past_context = json.dumps({"max_tokens": 2, "prompt": [1] * (max_model_len + 8)}).encode()
    long_text = "a " * (limit // 2 - 48)
    text = json.dumps({"max_tokens": 2, "prompt": long_text}).encode()
    truncated = json.dumps({"max_tokens": 2, "prompt": long_text, "truncate_prompt_tokens": 16}).encode()
    responses = json.dumps({"max_output_tokens": 2, "input": [{"role": "user", "content": filler}] * count},
                           separators=(",", ":")).encode()
    plain: dict[str, str] = {}
    return {
        "over the limit (60 MB)": ("/v1/completions", b"[" + b"1," * 30_000_000 + b"1]", plain),
        "a million ids at the limit": ("/v1/completions", ids, plain),
        "empty messages at the limit": ("/v1/chat/completions", chat, plain),
        "ids past the context": ("/v1/completions", past_context, plain),
        "messages to render past the context": ("/v1/chat/completions", rendered, plain),
        "text past the context": ("/v1/completions", text, plain),
        "text past the context, truncated to 16 tokens": ("/v1/completions", truncated, plain),
        # not hostile: what any request of the truncated one's size costs the stream (its prefill and steps)
        "a 16-token text prompt (baseline)": ("/v1/completions", json.dumps({"max_tokens": 2,
                                                                             "prompt": "a " * 8}).encode(), plain),
        "text past the context, to /tokenize": ("/tokenize", json.dumps({"prompt": long_text}).encode(), plain),
        "a Responses input to render past the context": ("/v1/responses", responses, plain),
        "gzip bomb": ("/v1/completions", gzip.compress(b" " * (64 << 20), compresslevel=9),
                      {"Content-Encoding": "gzip"}),
    }


def post(port: int, path: str, body: bytes, headers: dict[str, str]) -> int | str:
    """The response's status; a connection the server closed before the body was all sent is
    recorded as such, not as the status it presumably carried."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **headers})
        response = conn.getresponse()
        response.read()
        return response.status
    except (BrokenPipeError, ConnectionResetError):
        return "closed while sending"
    finally:
        conn.close()


class Stream:
    """One user's long streamed answer; the arrival time of each of its tokens."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.port, self.max_tokens, self.arrivals = port, max_tokens, [time.perf_counter()]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": [1, 2, 3], "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        while not self.stop.is_set() and (line := response.readline()):
            if line.startswith(b"data"):
                self.arrivals.append(time.perf_counter())
        conn.close()

    def longest_gap_ms(self, start: float, end: float) -> float:
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False) if start <= b <= end]
        if not gaps:
            raise SystemExit("error: the streamed answer stopped; see the server's log")
        return round(max(gaps) * 1000, 2)


def trial(stream: Stream, send: Callable[[], int | str]) -> dict[str, Any]:
    idle_start = time.perf_counter()
    time.sleep(WINDOW_S)
    sent = time.perf_counter()
    status = send()
    answered = time.perf_counter()
    time.sleep(max(0.2, WINDOW_S - (answered - sent)))
    idle = stream.longest_gap_ms(idle_start, sent)
    during = stream.longest_gap_ms(sent, answered + 0.2)
    return {"status": status, "answered_s": round(answered - sent, 3), "idle_longest_gap_ms": idle,
            "longest_gap_ms": during, "stall_ms": round(max(0.0, during - idle), 2)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.hostile_bodies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--cases", nargs="*", default=None, help="only the cases whose names hold one of these words")
    p.add_argument("--port", type=int, default=50083, help="gRPC port; HTTP on --http-port")
    p.add_argument("--http-port", type=int, default=8083)
    p.add_argument("--server-args", default="", help="extra decode server flags")
    p.add_argument("--gil-switch-ms", type=float, nargs="+", default=[5.0],
                   help="run every case against a server started with each of these (default: the server's 5)")
    p.add_argument("--json", default="bench/results/hostile-bodies-h200.json")
    args = p.parse_args()
    limit = default_max_body_bytes(args.max_model_len)
    cases = {name: case for name, case in bodies(limit, args.max_model_len).items()
             if args.cases is None or any(word in name for word in args.cases)}
    settings = {}
    tokenizer = tokenizer_args(args.preset)  # one folder for every server started here
    for switch_ms in args.gil_switch_ms:
        server_args = ["--host", "127.0.0.1", "--port", str(args.port), "--http-port", str(args.http_port),
                       "--metrics-port", "0", "--preset", args.preset, "--device", args.device, "--mode", "colocated",
                       "--max-model-len", str(args.max_model_len), "--gil-switch-ms", f"{switch_ms:g}",
                       *tokenizer, *args.server_args.split()]
        print(f"--gil-switch-ms {switch_ms:g}", flush=True)
        results = run_cases(server_args, cases, args)
        worst = {name: max(r["stall_ms"] for r in rows) for name, rows in results.items()}
        settings[f"{switch_ms:g}"] = {
            "server": f"python -m decode_server {' '.join(server_args)}", "worst_stall_ms": worst,
            "median_stall_ms": {n: statistics.median(r["stall_ms"] for r in rows) for n, rows in results.items()},
            "within_target": all(v <= TARGET_MS for v in worst.values()), "cases": results}
        print(f"worst stall per case (ms): {worst}", flush=True)
    doc = {**metadata(), "model": f"preset:{args.preset}", "device": args.device, "body_limit_bytes": limit,
           "trials": args.trials, "target_stall_ms": TARGET_MS, "gil_switch_ms": settings}
    write_json(args.json, doc)
    print(f"wrote {args.json}")


def run_cases(server_args: list[str], cases: dict[str, tuple[str, bytes, dict[str, str]]],
              args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Every case's trials against one server, while one user streams."""
    logs = Path(tempfile.mkdtemp())
    server = ServerProcess("decode_server", server_args, f"127.0.0.1:{args.port}", logs / "decode_server.log")
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        server.start(timeout=900)
        stream = Stream(args.http_port, args.max_model_len - 8)
        stream.thread.start()
        time.sleep(2.0)  # past the first tokens
        for name, (path, body, headers) in cases.items():
            results[name] = []
            for k in range(args.trials):
                row = trial(stream, lambda: post(args.http_port, path, body, headers))  # noqa: B023
                results[name].append(row)
                print(f"{name:36s} trial {k + 1}: {row['status']} in {row['answered_s']:.2f} s; longest gap "
                      f"{row['longest_gap_ms']:.1f} ms (idle {row['idle_longest_gap_ms']:.1f}): stall "
                      f"{row['stall_ms']:.1f} ms", flush=True)
        stream.stop.set()
    except ServerFailed as e:
        raise SystemExit(f"error: {e}") from e
    finally:
        server.stop(timeout=60)
    return results


if __name__ == "__main__":
    main()
