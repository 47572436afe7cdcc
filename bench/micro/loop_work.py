"""`python -m bench.micro.loop_work`: the work a 32k-token prompt puts on the servers' event loops, on
the CPU: each step a Generate handler runs before its first await that yields (parse, checks,
admission), the Prefill request the decode server builds and gRPC serializes, and the prefill
server's handler up to its worker's queue. Median milliseconds over `--repeats`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pd.v1 import decode_pb2, prefill_pb2

from bench.common import metadata
from decode_server.admission import Admission
from decode_server.config import DecodeConfig
from decode_server.core import DecodeCore
from decode_server.request_parser import RequestParser
from decode_server.scheduler import BatchScheduler
from decode_server.service import DecodeService
from engine.offline import make_runner
from serving.validation import check_lengths, check_token_ids


def median_ms(step: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


async def measure(tokens: int, repeats: int) -> dict[str, float]:
    runner = make_runner(preset="tiny", max_model_len=tokens + 64, kv_gb=0.25)
    loop = asyncio.get_running_loop()
    cfg = DecodeConfig()
    admission = Admission(runner.pool, 16, 1 << 22, loop)
    scheduler = BatchScheduler(runner, admission, 4)
    core = DecodeCore(cfg, scheduler, None, frozenset())
    parser = RequestParser(cfg, None, runner.max_model_len, runner.config.vocab_size, scheduler.check_prefill_sms)
    rng = random.Random(0)
    raw = decode_pb2.GenerateRequest(token_ids=[rng.randrange(256) for _ in range(tokens)], max_new_tokens=16,
                                     ignore_eos=True).SerializeToString()
    request = decode_pb2.GenerateRequest.FromString(raw)
    parsed = await parser.parse(DecodeService._fields(request, "r"), time.perf_counter())
    seq = core.accept(parsed).seq
    core.in_flight.clear()

    def parse() -> None:  # token ids: no await in it, so one send runs it to its end
        with contextlib.suppress(StopIteration):
            parser.parse(DecodeService._fields(request, "r"), 0.0).send(None)

    def reserve() -> None:
        blocks = runner.pool.allocator.allocate(runner.pool.blocks_needed(seq.total_tokens))
        runner.pool.allocator.free(blocks)

    sampling = decode_pb2.SamplingParams()
    prefill_raw = prefill_pb2.PrefillRequest(request_id="r", token_ids=seq.prompt).SerializeToString()
    received = prefill_pb2.PrefillRequest.FromString(prefill_raw)
    vocab = runner.config.vocab_size

    def prefill_checks() -> None:
        check_lengths(len(received.token_ids), 1, runner.max_model_len)
        check_token_ids(received.token_ids, vocab)
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(received.token_ids)))
        runner.pool.allocator.free(table)

    return {
        "decode: GenerateRequest from bytes": median_ms(lambda: decode_pb2.GenerateRequest.FromString(raw), repeats),
        "decode: parse (fields read, checks, token ids)": median_ms(parse, repeats),
        "decode: admission's blocks (allocate + free)": median_ms(reserve, repeats),
        "decode: PrefillRequest built": median_ms(lambda: prefill_pb2.PrefillRequest(
            request_id="r", token_ids=seq.prompt, sampling=sampling), repeats),
        "decode: PrefillRequest serialized (gRPC)": median_ms(lambda: prefill_pb2.PrefillRequest(
            request_id="r", token_ids=seq.prompt, sampling=sampling).SerializeToString(), repeats),
        "prefill: PrefillRequest from bytes": median_ms(lambda: prefill_pb2.PrefillRequest.FromString(prefill_raw),
                                                        repeats),
        "prefill: checks and blocks": median_ms(prefill_checks, repeats),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.loop_work", description=__doc__)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    results = asyncio.run(measure(args.tokens, args.repeats))
    meta = metadata()
    print(f"{args.tokens}-token prompt, {meta['hardware']}, commit {meta['commit']}: median ms of {args.repeats}")
    for what, ms in results.items():
        print(f"  {what:<46} {ms:7.3f}")


if __name__ == "__main__":
    main()
