"""Warm-up at start-up runs every local prefill path once, each stage timed in the log, and leaves
the pool as it found it: every block free, and a request's tokens the same as on a cold engine."""

from __future__ import annotations

import asyncio
import logging

import pytest

from decode_server.admission import Admission
from decode_server.config import CHUNK_SIZES, DecodeConfig, PrefillMode
from decode_server.core import DecodeCore, Request
from decode_server.scheduler import BatchScheduler
from engine.offline import generate, make_runner
from engine.sampling import SamplingParams
from serving.token_ids import token_ids


def test_the_engine_warms_every_path_before_it_serves(caplog: pytest.LogCaptureFixture) -> None:
    runner = make_runner(preset="tiny", max_model_len=512, kv_gb=0.004)
    prompt = [(i * 7 + 3) % 256 for i in range(90)]
    cold = generate(runner, [prompt], 6)[0]

    async def main() -> list[int]:
        admission = Admission(runner.pool, 4, 1 << 20, asyncio.get_running_loop())
        scheduler = BatchScheduler(runner, admission, max_batch_size=4, layer_slice_tokens=64, warm_up=True)
        core = DecodeCore(DecodeConfig(), scheduler, None, frozenset())
        with caplog.at_level(logging.INFO, logger="engine.warmup"):
            scheduler.start()  # returns once warmed up
        assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
        try:
            generation = core.accept(Request("after", token_ids(prompt), 6, SamplingParams(), frozenset(), True,
                                             PrefillMode.CHUNKED, 32, 0.0))
            tokens = [out.token_id async for out in generation.run()]
            core.finish(generation, "OK")
            return tokens
        finally:
            scheduler.stop()

    assert asyncio.run(main()) == cold
    stages = [r.getMessage() for r in caplog.records if r.name == "engine.warmup"]
    assert [s.split(" in ")[0] for s in stages] == [
        "warm-up: whole prompts", f"warm-up: chunks of {CHUNK_SIZES[0]}-{CHUNK_SIZES[-1]} tokens",
        "warm-up: layer slices", "warm-up: sampling"]
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
