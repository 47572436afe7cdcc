"""`python -m bench.e2e.auto_thresholds`: where mode auto's thresholds come from. For each prompt length, fresh
prompts are prefilled here (colocated) and on the prefill server (disaggregated), with nobody else
decoding and then with --background-users decoding on the decode server; each records its TTFT and,
when busy, the longest gap it caused in the other users' token streams.

The crossovers are the defaults to take: `--auto-idle-local-tokens`, the longest prompt up to which
a local prefill answers sooner than a remote one, by at least --margin-ms, at every length measured,
with nobody decoding; `--auto-local-tokens`, the same with users decoding, where the local prefill
must also stall them less than --stall-ms. A gain inside the margin (about one decode step) is
noise, not a reason to stall anyone. Prefill server on the first device, decode server on the last
(one device: both on it). `--from-json` re-derives the crossovers from recorded rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pd.v1 import decode_pb2, decode_pb2_grpc

from bench.common import metadata, write_json
from client.event_loop import run_event_loop
from client.stream import PREFILL_MODES, collect, open_channel
from launcher.process import ServerFailed, ServerProcess, start_all, stop_all

LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
MODES = ("colocated", "disaggregated")


class Background:
    """Users decoding back to back; every token's arrival time is kept to find the gaps a prefill caused."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, users: int, output_len: int) -> None:
        self.stub, self.users, self.output_len = stub, users, output_len
        self.arrivals: list[list[float]] = [[] for _ in range(users)]
        self.stopped = asyncio.Event()

    async def user(self, index: int) -> None:
        rng = random.Random(1000 + index)
        while not self.stopped.is_set():
            request = decode_pb2.GenerateRequest(token_ids=[rng.randrange(256) for _ in range(256)],
                                                 max_new_tokens=self.output_len, ignore_eos=True,
                                                 prefill_mode=PREFILL_MODES["colocated"])
            call = self.stub.Generate(request, timeout=600)
            async for _ in call:
                self.arrivals[index].append(time.perf_counter())
                if self.stopped.is_set():
                    call.cancel()
                    break

    def longest_gap(self, start: float, end: float) -> float:
        """The longest gap between two tokens of one user that overlaps [start, end]."""
        gaps = [b - a for times in self.arrivals for a, b in zip(times, times[1:], strict=False)
                if b >= start and a <= end]
        return max(gaps, default=0.0)


async def measure(address: str, lengths: list[int], reps: int, users: int, output_len: int) -> list[dict[str, Any]]:
    channel = open_channel(address)
    stub = decode_pb2_grpc.DecodeStub(channel)
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    try:
        for busy in (False, True):
            background = Background(stub, users if busy else 0, output_len)
            tasks = [asyncio.ensure_future(background.user(i)) for i in range(background.users)]
            while busy and not all(background.arrivals):
                await asyncio.sleep(0.05)  # every user is decoding
            for length in lengths:
                for mode in MODES:
                    ttfts, stalls = [], []
                    for _ in range(reps):  # fresh tokens each time: no prefix cache hit
                        request = decode_pb2.GenerateRequest(
                            token_ids=[rng.randrange(256) for _ in range(length)], max_new_tokens=2, ignore_eos=True,
                            prefill_mode=PREFILL_MODES[mode])
                        result = await collect(stub, request, 600)
                        if result.error is not None:
                            raise RuntimeError(f"{mode} prefill of {length} tokens failed: {result.error_message}")
                        ttfts.append(result.ttft)
                        stalls.append(background.longest_gap(result.sent_at, result.arrivals[0]))
                    rows.append({"busy": busy, "background_users": background.users, "prompt_tokens": length,
                                 "mode": mode, "ttft_ms_p50": round(statistics.median(ttfts) * 1e3, 3),
                                 "stall_ms_p50": round(statistics.median(stalls) * 1e3, 3) if busy else None})
                    print(rows[-1], file=sys.stderr)
            background.stopped.set()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await channel.close()
    return rows


def crossovers(rows: list[dict[str, Any]], stall_ms: float, margin_ms: float = 0.0) -> dict[str, int | None]:
    """The longest prompt length up to which local wins at every length, idle and busy (None: not even the
    shortest)."""
    def row(busy: bool, length: int, mode: str) -> dict[str, Any]:
        return next(r for r in rows if r["busy"] == busy and r["prompt_tokens"] == length and r["mode"] == mode)

    def local_wins(busy: bool, n: int) -> bool:
        local, remote = row(busy, n, "colocated"), row(busy, n, "disaggregated")
        sooner = local["ttft_ms_p50"] + margin_ms <= remote["ttft_ms_p50"]
        return sooner and (not busy or local["stall_ms_p50"] <= stall_ms)

    def longest(busy: bool) -> int | None:
        last = None
        for n in sorted({r["prompt_tokens"] for r in rows}):
            if not local_wins(busy, n):
                break
            last = n
        return last

    return {"auto_idle_local_tokens": longest(False), "auto_local_tokens": longest(True)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.auto_thresholds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:1"], help="prefill device, decode device")
    p.add_argument("--kv-transport", default="auto")
    p.add_argument("--kv-cache-gb", type=float, default=30.0)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--reps", type=int, default=5, help="prompts per length and mode (default 5)")
    p.add_argument("--background-users", type=int, default=16)
    p.add_argument("--background-output-len", type=int, default=4096)
    p.add_argument("--stall-ms", type=float, default=50.0,
                   help="the longest stall of the other users a local prefill may cause (default: 50, the load's "
                        "ITL limit for goodput)")
    p.add_argument("--margin-ms", type=float, default=5.0,
                   help="how much sooner a local prefill must answer to count as sooner (default: 5, a decode step)")
    p.add_argument("--from-json", metavar="PATH",
                   help="no measuring: re-derive the crossovers of the rows recorded in PATH and write them back")
    p.add_argument("--port", type=int, default=50081)
    p.add_argument("--server-args", default="", help="extra flags for both servers")
    p.add_argument("--json", default="bench/results/placement-2xh200.json")
    p.add_argument("--logs", default=None)
    args = p.parse_args()
    if args.from_json:
        rederive(Path(args.from_json), args.stall_ms, args.margin_ms)
        return
    if len(args.devices) not in (1, 2):
        p.error("--devices takes one or two devices")
    common = ["--host", "127.0.0.1", "--metrics-port", "0", "--preset", args.preset, "--kv-cache-gb",
              str(args.kv_cache_gb), "--kv-transport", args.kv_transport, "--no-prefix-cache",
              *args.server_args.split()]
    logs = Path(args.logs or tempfile.mkdtemp())
    prefill_address, decode_address = f"127.0.0.1:{args.port + 1}", f"127.0.0.1:{args.port}"
    servers = [
        ServerProcess("prefill_server", [*common, "--device", args.devices[0], "--port", str(args.port + 1)],
                      prefill_address, logs / "prefill.log"),
        ServerProcess("decode_server", [*common, "--device", args.devices[-1], "--port", str(args.port),
                                        "--prefill-addr", prefill_address], decode_address, logs / "decode.log")]
    try:
        start_all(servers, timeout=900)
        rows = run_event_loop(measure(decode_address, args.lengths, args.reps, args.background_users,
                                      args.background_output_len))
    except ServerFailed as e:
        sys.exit(f"error: {e}")
    finally:
        stop_all(servers, timeout=60)
    doc = {**metadata(), "preset": args.preset, "devices": args.devices, "kv_transport": args.kv_transport,
           "stall_ms": args.stall_ms, "margin_ms": args.margin_ms,
           "servers": [f"python -m {s.module} {' '.join(s.args)}" for s in servers],
           "rows": rows, "suggested": crossovers(rows, args.stall_ms, args.margin_ms)}
    write_json(args.json, doc)
    print(f"suggested thresholds: {doc['suggested']}; wrote {args.json}")


def rederive(path: Path, stall_ms: float, margin_ms: float) -> None:
    doc = json.loads(path.read_text())
    suggested = crossovers(doc["rows"], stall_ms, margin_ms)
    doc.update({"stall_ms": stall_ms, "margin_ms": margin_ms, "suggested": suggested,
                "suggested_by": f"python -m bench.e2e.auto_thresholds --from-json {path} --stall-ms {stall_ms:g} "
                                f"--margin-ms {margin_ms:g} (commit {metadata()['commit']})"})
    write_json(path, doc)
    print(f"suggested thresholds: {suggested}; wrote {path}")


if __name__ == "__main__":
    main()
