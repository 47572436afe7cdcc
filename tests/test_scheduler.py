"""The decode server's request core and batch scheduler without gRPC: a request's tokens come out
of its `Generation`, a remote prefill's first token enters through the scheduler like a local
one, and every ending gives the KV blocks back, to the next request waiting for them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from decode_server.admission import Admission
from decode_server.config import DecodeConfig, PrefillMode
from decode_server.core import DecodeCore, Generation, Request
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import Rejected, RequestSequence, TokenOutput
from engine.host_read import TokenReader
from engine.logprobs import TokenLogprobs
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(preset="tiny", max_model_len=1024, kv_gb=0.002)  # a pool of a few requests


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 5 + 1) % 256 for i in range(n)]


def request(request_id: str, tokens: list[int], new: int, mode: PrefillMode = PrefillMode.COLOCATED) -> Request:
    return Request(request_id, tokens, new, SamplingParams(), frozenset(), True, mode, 64, 0.0)


def core_for(runner: ModelRunner, **limits: int) -> DecodeCore:
    admission = Admission(runner.pool, limits.get("max_queued", 16), limits.get("max_waiting_tokens", 1 << 20),
                          asyncio.get_running_loop())
    return DecodeCore(DecodeConfig(), BatchScheduler(runner, admission, max_batch_size=4), None, frozenset())


async def run(generation: Generation) -> list[int]:
    return await drain(generation.run())


async def drain(outputs: AsyncIterator[TokenOutput]) -> list[int]:
    return [out.token_id async for out in outputs]


def test_tokens_come_out_of_the_generation_and_every_block_goes_back(runner: ModelRunner) -> None:
    prompts = [prompt(40, 1), prompt(70, 2), prompt(25, 3)]
    alone = [generate(runner, [p], 9)[0] for p in prompts]

    async def main() -> list[list[int]]:
        core = core_for(runner)
        core.scheduler.start()
        try:
            generations = [core.accept(request(f"r{i}", p, 9)) for i, p in enumerate(prompts)]
            tokens = await asyncio.gather(*(run(g) for g in generations))
            for g in generations:
                core.finish(g, "OK")
            assert core.in_flight == set()
            return tokens
        finally:
            core.scheduler.stop()

    assert asyncio.run(main()) == alone
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks


def test_a_remote_first_token_is_appended_on_the_scheduler_thread(runner: ModelRunner) -> None:
    """The prompt's KV is written as a transfer would, then the sequence is submitted with the first
    token a prefill server sampled: the scheduler appends it (nothing is appended at submit) and
    decodes on from it, to the tokens a local prefill gives."""
    tokens = prompt(50, 4)
    alone = generate(runner, [tokens], 7)[0]

    async def main() -> tuple[list[int], list[str]]:
        core = core_for(runner)
        scheduler = core.scheduler
        seq = RequestSequence("remote", tokens, 7, SamplingParams(), frozenset(), frozenset(),
                              PrefillMode.DISAGGREGATED, 64)
        await core.admission.reserve(seq)
        runner.prefill(tokens, seq.block_table, 0)
        threads: list[str] = []
        append = seq.append

        def recording_append(token: int, step_s: float, now: float,
                             logprobs: TokenLogprobs | None = None) -> TokenOutput:
            threads.append(threading.current_thread().name)
            return append(token, step_s, now, logprobs)

        seq.append = recording_append  # type: ignore[method-assign]
        scheduler.submit(seq, first_token=alone[0])
        assert seq.tokens == []
        scheduler.start()
        try:
            out = [await seq.out.next() for _ in range(7)]
        finally:
            scheduler.stop()
        assert all(isinstance(o, TokenOutput) for o in out)
        return [o.token_id for o in out if isinstance(o, TokenOutput)], threads

    tokens_out, threads = asyncio.run(main())
    assert tokens_out == alone
    assert set(threads) == {"decode-engine"}
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks


class HeldReader(TokenReader):
    """A device still running a decode step: once armed, the next step's tokens are not ready
    until the test releases them."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner.device)
        self.armed, self.held, self.released = threading.Event(), threading.Event(), threading.Event()

    def start(self, tokens: torch.Tensor) -> None:
        super().start(tokens)
        if self.armed.is_set() and not self.held.is_set():
            self.held.set()

    def ready(self) -> bool:
        return not self.held.is_set() or self.released.is_set()

    def take(self) -> list[int]:
        if self.held.is_set():
            self.released.wait(10)
        return super().take()


def test_a_remote_first_token_leaves_during_the_decode_step_under_way(runner: ModelRunner) -> None:
    """A decodes; B's first token arrives from its remote prefill (its KV in the pool) while A's decode step is still
    on the device: B's token leaves before that step ends, not one step later."""
    b_prompt = prompt(50, 8)
    b_alone = generate(runner, [b_prompt], 5)[0]

    async def main() -> tuple[list[int], int, int]:
        core = core_for(runner)
        scheduler = core.scheduler
        reader, twin = HeldReader(runner), HeldReader(runner)  # decode steps alternate two readers
        twin.armed, twin.held, twin.released = reader.armed, reader.held, reader.released
        scheduler.decode.readers = [reader, twin]
        b = RequestSequence("b", b_prompt, 5, SamplingParams(), frozenset(), frozenset(), PrefillMode.DISAGGREGATED, 64)
        await core.admission.reserve(b)
        runner.prefill(b_prompt, b.block_table, 0)  # as a transfer would
        scheduler.start()
        a = core.accept(request("a", prompt(30, 9), 400))
        a_stream = a.run()
        for _ in range(2):  # A is decoding
            await a_stream.__anext__()
        a_tokens = asyncio.ensure_future(drain(a_stream))
        try:
            remote_prefill: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            submitted = asyncio.ensure_future(scheduler.submit_after_remote_prefill(b, remote_prefill))
            await asyncio.sleep(0)  # B's remote prefill is under way
            reader.armed.set()
            assert await asyncio.to_thread(reader.held.wait, 10)
            steps_at_arrival = scheduler.steps
            remote_prefill.set_result(b_alone[0])  # its KV is in the pool: the first token arrives
            await submitted
            first = await asyncio.wait_for(b.out.next(), 5)  # before the fix: only once the step is released
            steps_at_first = scheduler.steps
            assert not reader.released.is_set()
            reader.released.set()
            rest = [await b.out.next() for _ in range(4)]
            a_tokens.cancel()  # A's client leaves
            await asyncio.gather(a_tokens, return_exceptions=True)
            core.finish(a, "CANCELLED")
            allocator = runner.pool.allocator
            for _ in range(500):  # the scheduler drops A at its next step
                if allocator.num_free == allocator.num_blocks:
                    break
                await asyncio.sleep(0.01)
        finally:
            reader.released.set()
            scheduler.stop()
        outs = [first, *rest]
        assert all(isinstance(o, TokenOutput) for o in outs)
        return [o.token_id for o in outs if isinstance(o, TokenOutput)], steps_at_arrival, steps_at_first

    tokens, steps_at_arrival, steps_at_first = asyncio.run(main())
    assert tokens == b_alone
    assert steps_at_first == steps_at_arrival  # no step ended between the arrival and B's first token
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks


def test_a_request_let_go_before_the_scheduler_had_it_frees_its_blocks_for_the_next_in_line(
        runner: ModelRunner) -> None:
    """A holds most of the pool and B waits for it; A ends before it reached the scheduler (as a
    failed remote prefill does): its blocks go back through the scheduler and B is admitted."""
    blocks = runner.pool.allocator.num_blocks
    per_block = runner.pool.layout.block_size
    big = (blocks - 2) * per_block

    async def main() -> None:
        core = core_for(runner)
        core.scheduler.start()
        try:
            a = core.accept(request("a", prompt(big - 8, 5), 8))
            await core.admission.reserve(a.seq)  # as Generation.run does first
            b = core.accept(request("b", prompt(4 * per_block, 6), 4))
            b_tokens = asyncio.ensure_future(run(b))
            await asyncio.sleep(0.05)
            assert core.admission.waiting == 1 and not b_tokens.done()
            core.finish(a, "UNAVAILABLE")
            assert len(await asyncio.wait_for(b_tokens, 10)) == 4
            core.finish(b, "OK")
        finally:
            core.scheduler.stop()

    asyncio.run(main())
    assert runner.pool.allocator.num_free == blocks


def test_a_dead_scheduler_fails_what_it_held_and_what_comes_after(runner: ModelRunner) -> None:
    async def main() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        admission = Admission(runner.pool, 16, 1 << 20, asyncio.get_running_loop())
        scheduler = BatchScheduler(runner, admission, max_batch_size=4, die_after_steps=3)
        core = DecodeCore(DecodeConfig(), scheduler, None, frozenset())
        scheduler.start()
        codes = []
        for name in ("during", "after"):
            generation = core.accept(request(name, prompt(30, 7), 50))
            with pytest.raises(Rejected) as failed:
                await asyncio.wait_for(run(generation), 10)
            core.finish(generation, failed.value.code.name)
            codes.append(failed.value.code)
        scheduler.stop()
        return codes[0], codes[1]

    assert asyncio.run(main()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
