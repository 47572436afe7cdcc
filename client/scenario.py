"""`python -m client.scenario`: the A/B experiment end to end over gRPC.

User A sends a 1,024-token prompt and receives 100 tokens; just before A's 20th token arrives
(when its 19th does), B sends a long prompt. B is a second client: a process of its own with its
own channel (client.second_user). Each row runs that once in one prefill mode and records every
gap between A's tokens as the client saw them and as the decode server stamped them (a slow gap in
the first and not the second came from the client or the network), and B's time to first token.

Every run (B's reference, A alone, each row) is sent with a fresh `cache_salt`, so the servers'
prefix caches, on by default, find nothing of an earlier run: each row measures a real prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from pd.v1 import decode_pb2, decode_pb2_grpc

from client.scenario_report import Row, format_table, plot_gaps
from client.second_user import SecondUser
from client.stream import PREFILL_MODES, StreamResult, Unreachable, collect, open_channel, stream_generate, wait_ready

MODE_ENUM = {"alone": decode_pb2.PREFILL_MODE_UNSPECIFIED, **PREFILL_MODES}
DEFAULT_MODES = "alone,disaggregated,colocated,chunked:512,chunked:2048,layered"


@dataclass(frozen=True)
class ScenarioSpec:
    a_len: int = 1024
    a_new_tokens: int = 100
    b_trigger_index: int = 18    # B is sent when A's token #19 (index 18) arrives, before the 20th
    b_new_tokens: int = 16
    seed: int = 0


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def request(tokens: list[int], new_tokens: int, mode: str, size: int | None, request_id: str,
            salt: str = "") -> decode_pb2.GenerateRequest:
    """`size`: the chunk size of chunked, the prefill SM count of partitioned (None: the server's);
    `salt`: the prefix-cache namespace of the run it belongs to."""
    return decode_pb2.GenerateRequest(request_id=request_id, token_ids=tokens, max_new_tokens=new_tokens,
                                      ignore_eos=True, prefill_mode=MODE_ENUM[mode],
                                      chunk_size=(size or 0) if mode == "chunked" else 0,
                                      prefill_sms=(size or 0) if mode == "partitioned" else 0, cache_salt=salt)


async def run_pair(stub: decode_pb2_grpc.DecodeStub, second: SecondUser | None, spec: ScenarioSpec,
                   a_prompt: list[int], b_prompt: list[int] | None, mode: str, chunk_size: int | None,
                   tag: str, a_mode: str | None = None, salt: str = "") -> tuple[StreamResult, StreamResult | None]:
    """A streams; B (if any) is sent by the second user when A's trigger token arrives. Both run to
    completion. A runs disaggregated beside a disaggregated B, else colocated (unless `a_mode`); both are
    sent with `salt` as their cache salt."""
    a = StreamResult(sent_at=time.perf_counter())
    if a_mode is None:
        a_mode = "alone" if mode == "alone" else "disaggregated" if mode == "disaggregated" else "colocated"
    a_req = request(a_prompt, spec.a_new_tokens, a_mode, None, f"A-{tag}", salt)
    b_sent = False
    if b_prompt is not None:
        assert second is not None
        second.prepare(request(b_prompt, spec.b_new_tokens, mode, chunk_size, f"B-{tag}", salt))
    async for response, arrived in stream_generate(stub, a_req):
        a.add(response, arrived)
        if second is not None and b_prompt is not None and response.index == spec.b_trigger_index:
            second.send_now()
            b_sent = True
    b = await second.result() if second is not None and b_sent else None
    if b is not None and b.error is not None:
        raise RuntimeError(f"B failed in mode {mode}: {b.error.name}: {b.error_message}")
    return a, b


def first_diff(x: list[int], y: list[int]) -> int | None:
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if p != q:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def make_row(mode: str, chunk: int | None, b_len: int, a: StreamResult, b: StreamResult | None,
             solo: list[int], solo_median: float, b_ref: list[int], trigger: int) -> Row:
    gaps = a.gaps
    diff = first_diff(a.tokens, solo)
    row = Row(mode=mode, chunk_size=chunk if mode == "chunked" else None, b_len=b_len,
              a_median_gap_ms=statistics.median(gaps) * 1e3,
              a_worst_gap_ms=max(gaps) * 1e3, a_slow_gaps=sum(g > 2 * solo_median for g in gaps),
              b_ttft_ms=None, a_tokens_match_solo=diff is None, b_first_token_matches=None,
              a_first_diff_index=diff, a_gaps_ms=[g * 1e3 for g in gaps],
              a_server_gaps_ms=[g * 1e3 for g in a.server_gaps],
              prefill_sms=chunk if mode == "partitioned" else None)
    if b is not None:
        row.b_ttft_ms = b.ttft * 1e3
        row.b_first_token_matches = b.tokens[:1] == b_ref[:1]
        row.b_tokens_match_reference = b.tokens == b_ref
        row.b_sent_after_a_token = trigger
        row.b_first_token_during_gap = sum(t < b.arrivals[0] for t in a.arrivals) - 1
        if b.first is not None:
            if b.first.timing.cached_tokens:
                raise RuntimeError(f"B's prompt came from a prefix cache ({b.first.timing.cached_tokens} tokens) "
                                   "although its cache_salt was fresh, so nothing was prefilled; the decode server "
                                   "does not keep requests' cache namespaces apart")
            row.b_server_prefill_ms = b.first.timing.prefill_s * 1e3
            row.b_server_kv_transfer_ms = b.first.timing.kv_transfer_s * 1e3
    return row


def parse_modes(spec: str) -> list[tuple[str, int | None]]:
    modes: list[tuple[str, int | None]] = []
    for item in spec.split(","):
        name, _, chunk = item.strip().partition(":")
        if name not in MODE_ENUM:
            raise argparse.ArgumentTypeError(f"unknown mode {name!r}; choose from {', '.join(MODE_ENUM)}")
        if name == "chunked" and not chunk:
            raise argparse.ArgumentTypeError("chunked needs a size, e.g. chunked:512")
        modes.append((name, int(chunk) if chunk else None))
    return modes


async def run_scenario(target: str, b_lens: list[int], modes: list[tuple[str, int | None]], spec: ScenarioSpec,
                       tls_ca: str | None = None, log: Callable[[str], object] = print) -> list[Row]:
    channel = open_channel(target, tls_ca)
    try:
        await wait_ready(channel, target, log)
    except Unreachable:
        await channel.close()
        raise
    stub = decode_pb2_grpc.DecodeStub(channel)
    a_prompt = make_prompt(spec.a_len, spec.seed)
    rows: list[Row] = []
    second = SecondUser(target, tls_ca)
    run = uuid.uuid4().hex[:12]  # this replay's salts: nothing of an earlier replay is found either
    try:
        await collect(stub, request(a_prompt[:64], 4, "alone", None, "warmup", f"{run}-warmup"))
        for b_len in b_lens:
            b_prompt = make_prompt(b_len, spec.seed + b_len)
            # B alone, whole prompt at once: the reference for B's tokens (and a warm-up of that size)
            ref = await collect(stub, request(b_prompt, spec.b_new_tokens, "colocated", None, f"Bref-{b_len}",
                                              f"{run}-Bref-{b_len}"))
            if ref.error is not None:
                raise RuntimeError(f"reference run of B failed: {ref.error.name}: {ref.error_message}")
            solo, _ = await run_pair(stub, None, spec, a_prompt, None, "alone", None, f"solo-{b_len}",
                                     salt=f"{run}-solo-{b_len}")
            solo_median = statistics.median(solo.gaps)
            for mode, chunk in modes:
                tag = f"{mode}{chunk or ''}-{b_len}"
                if mode == "alone":
                    a, b = solo, None
                else:
                    if mode == "partitioned":  # its green context is made on first use: not in B's TTFT
                        await collect(stub, request(b_prompt[:64], 2, mode, chunk, f"warmup-{tag}",
                                                    f"{run}-warmup-{tag}"))
                    a, b = await run_pair(stub, second, spec, a_prompt, b_prompt, mode, chunk, tag, salt=f"{run}-{tag}")
                row = make_row(mode, chunk, b_len, a, b, solo.tokens, solo_median, ref.tokens,
                               spec.b_trigger_index)
                rows.append(row)
                log(f"  b_len={b_len:>6} {mode}{'' if chunk is None else f' {chunk}'}: "
                    f"A worst {row.a_worst_gap_ms:.1f} ms, B TTFT "
                    f"{'-' if row.b_ttft_ms is None else f'{row.b_ttft_ms:.1f} ms'}")
    finally:
        second.close()
        await channel.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m client.scenario", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:50051", help="decode server address (default: %(default)s)")
    p.add_argument("--b-len", type=int, nargs="+", default=[16384], help="B's prompt length(s) in tokens")
    p.add_argument("--b-new-tokens", type=int, default=16, help="tokens B asks for (default: %(default)s)")
    p.add_argument("--a-len", type=int, default=1024, help="A's prompt length (default: %(default)s)")
    p.add_argument("--a-new-tokens", type=int, default=100, help="tokens A receives (default: %(default)s)")
    p.add_argument("--modes", type=parse_modes, default=parse_modes(DEFAULT_MODES),
                   help=f"rows, comma-separated (default: {DEFAULT_MODES})")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    p.add_argument("--json", help="write {'rows': [...]} here")
    p.add_argument("--plot", help="draw A's gaps per mode into this PNG")
    p.add_argument("--tls-ca", help="PEM CA bundle, when the decode server uses TLS")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    spec = ScenarioSpec(a_len=args.a_len, a_new_tokens=args.a_new_tokens, b_new_tokens=args.b_new_tokens,
                        seed=args.seed)
    if spec.a_new_tokens <= spec.b_trigger_index + 2:
        sys.exit("error: --a-new-tokens must exceed 20 so B arrives while A decodes")
    print(f"scenario against {args.target}: A {spec.a_len} tokens -> {spec.a_new_tokens}, "
          f"B {args.b_len} -> {spec.b_new_tokens}", file=sys.stderr)
    try:
        rows = asyncio.run(run_scenario(args.target, args.b_len, args.modes, spec, args.tls_ca,
                                        log=lambda m: print(m, file=sys.stderr)))
    except Exception as e:  # one line for the user: unreachable server, a failed request
        sys.exit(f"error: {e}")
    print(format_table(rows))
    if args.json:
        doc = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "target": args.target,
               "command": "python -m client.scenario " + " ".join(argv if argv is not None else sys.argv[1:]),
               "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot_gaps(rows, args.plot)


if __name__ == "__main__":
    main()
