"""`python -m bench.micro.loop_work`: the work a 32k-token prompt puts on the servers' event loops, on
the CPU: each step a Generate handler runs before its first await that yields (parse, checks,
admission), the Prefill request the decode server builds and gRPC serializes, and the prefill
server's handler up to its worker's queue; and the prefix cache's work on a 32k prompt, which the
arrival benchmark (`bench.e2e.arrival`, run with `--no-prefix-cache`) leaves out: the lookup of a
cached prefix at admission (event loop) and the publish of a prompt's blocks when its first token
comes (engine thread, holding the GIL the event loop needs); and one full pass of the garbage
collector over this process (the servers' modules and the tiny model), which every thread waits
for, with the start-up objects frozen as the servers now do and, before that, unfrozen. Median
milliseconds over `--repeats` (the collector's passes: over 5);
`--json` writes them with the date, hardware, commit and command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pd.v1 import decode_pb2, prefill_pb2

from bench.common import metadata, write_json
from decode_server.admission import Admission
from decode_server.config import DecodeConfig
from decode_server.core import DecodeCore
from decode_server.request_parser import RequestParser
from decode_server.scheduler import BatchScheduler
from decode_server.service import DecodeService
from engine.kv_cache import BlockAllocator
from engine.offline import make_runner
from engine.prefix_cache import PrefixCache
from serving.validation import check_lengths, check_token_ids


def median_ms(step: Callable[[], Any], repeats: int, reset: Callable[[], Any] | None = None) -> float:
    """`step`'s median time; `reset`, untimed, runs after each (to undo what the step took)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        if reset is not None:
            reset()
    return statistics.median(times) * 1e3


def full_collector_pass(prompt: decode_pb2.GenerateRequest, block_size: int) -> dict[str, float]:
    """gc.collect() over this process as it is, and with what it holds frozen (then thawed again)
    beside what serving adds: a prefix cache holding the prompt's blocks."""
    repeats = 5
    unfrozen = median_ms(gc.collect, repeats)
    gc.freeze()
    try:
        tokens = prompt.token_ids
        cache = PrefixCache(BlockAllocator(len(tokens) // block_size + 2, first=1), block_size)
        table, _ = cache.acquire(tokens, -(-len(tokens) // block_size))
        cache.publish(tokens, table, len(tokens))
        frozen = median_ms(gc.collect, repeats)
    finally:
        gc.unfreeze()
    return {"any thread: a full garbage-collector pass": unfrozen,
            "any thread: the same, start-up objects frozen, one prompt cached": frozen}


def prefix_cache_pieces(prompt: decode_pb2.GenerateRequest, block_size: int, repeats: int) -> dict[str, float]:
    """A 32k prompt against a cache that holds all of it (the lookup a later turn's admission makes),
    and the publish of a prompt's blocks into an empty cache (its first token's, on the engine thread)."""
    tokens = prompt.token_ids
    blocks = -(-len(tokens) // block_size) + 1
    cache = PrefixCache(BlockAllocator(2 * blocks + 1, first=1), block_size)
    table, _ = cache.acquire(tokens, blocks)
    cache.publish(tokens, table, len(tokens))
    held: list[list[int]] = []
    fresh: list[tuple[PrefixCache, list[int]]] = []

    def new_cache() -> None:
        empty = PrefixCache(BlockAllocator(blocks + 1, first=1), block_size)
        fresh[:] = [(empty, empty.acquire(tokens, blocks)[0])]

    def publish() -> None:
        empty, own = fresh[-1]
        empty.publish(tokens, own, len(tokens))

    new_cache()
    return {
        "decode: admission, its whole prefix cached (lookup + blocks)": median_ms(
            lambda: held.append(cache.acquire(tokens, blocks)[0]), repeats, lambda: cache.release(held.pop())),
        "decode, engine thread: a prompt's blocks published": median_ms(publish, repeats, new_cache),
    }


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
        **full_collector_pass(request, runner.layout.block_size),
        **prefix_cache_pieces(request, runner.layout.block_size, repeats),
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
    p.add_argument("--json", default=None, help="also write the figures here (e.g. bench/results/loop_work-cpu.json)")
    args = p.parse_args()
    results = asyncio.run(measure(args.tokens, args.repeats))
    meta = metadata()
    print(f"{args.tokens}-token prompt, {meta['hardware']}, commit {meta['commit']}: median ms of {args.repeats}")
    for what, ms in results.items():
        print(f"  {what:<62} {ms:7.3f}")
    if args.json:
        write_json(args.json, {**meta, "tokens": args.tokens, "repeats": args.repeats, "median_ms": results})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
