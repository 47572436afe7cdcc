"""Partitioned prefill in the batch scheduler: a whole prompt prefilled on its own thread while the
running batch keeps decoding. On the CPU the thread runs unconfined (no green contexts); the
device's version is in test_cuda_partitioned.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from decode_server import partitioned
from decode_server.admission import Admission
from decode_server.config import PrefillMode
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import Rejected
from engine.green_context import Unconfined
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from tests.test_layered_prefill import Seen, busy, make_seq, prompt


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(preset="tiny", max_model_len=1024)



class Gated(Unconfined):
    """Holds each prefill at the door of its partition until the test lets it in; records the SM
    counts asked for; `fail` makes entering raise, as a green context the driver refuses would."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go = threading.Event()
        self.asked: list[int] = []
        self.fail: Exception | None = None

    @contextlib.contextmanager
    def confine(self, num_sms: int) -> Iterator[None]:
        self.asked.append(num_sms)
        self.inside.set()
        assert self.go.wait(30), "the test never let the prefill in"
        if self.fail is not None:
            raise self.fail
        yield


def started(runner: ModelRunner, loop: asyncio.AbstractEventLoop, gate: Gated,
            short_first: bool = False) -> BatchScheduler:
    """A scheduler with its partitioned-prefill thread running (the test drives `step` itself)."""
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, partitions=gate,
                       prefill_sms=64, overlap_steps=False,  # each step's token counted as it is sampled
                       partitioned_short_first=short_first)
    assert s.local.partitioned is not None
    gate.go.set()  # the thread's start-up enters the partition once
    s.local.partitioned.start()
    gate.inside.clear()
    gate.go.clear()
    gate.asked.clear()
    return s


def run_until_done(s: BatchScheduler, limit: int = 2000) -> None:
    for _ in range(limit):
        if not busy(s):
            return
        s.step()
    raise AssertionError("the scheduler did not finish")


def test_a_decodes_while_b_prefills_beside_it_and_both_get_their_reference_tokens(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    a_prompt, b_prompt = prompt(120, 1), prompt(400, 2)
    a_alone, b_alone = generate(runner, [a_prompt], 30)[0], generate(runner, [b_prompt], 10)[0]
    gate = Gated()
    s = started(runner, loop, gate)
    seen = Seen()
    a = make_seq(s, a_prompt, 30, PrefillMode.COLOCATED)
    s.submit(a)
    s.step()
    b = make_seq(s, b_prompt, 10, PrefillMode.PARTITIONED)
    s.submit(b)
    s.step()
    assert gate.inside.wait(30)  # B's prefill has its own thread now, held there
    for n in range(5):
        s.step()
        assert len(seen.tokens(a)) == 3 + n  # A keeps its step every iteration, B's prefill or not
    assert seen(b) == [] and s.local.in_partition == [b]
    gate.go.set()
    run_until_done(s)
    assert seen.tokens(a) == a_alone
    assert seen.tokens(b) == b_alone
    assert gate.asked == [64]
    assert not any(isinstance(o, Rejected) for o in seen(a) + seen(b))
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
    s.local.partitioned.stop()  # type: ignore[union-attr]


def test_cancelled_mid_prefill_frees_its_blocks_only_once_the_prefill_is_done(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    gate = Gated()
    s = started(runner, loop, gate)
    free_before = runner.pool.allocator.num_free
    gone = make_seq(s, prompt(500, 3), 8, PrefillMode.PARTITIONED)
    s.submit(gone)
    s.step()
    assert gate.inside.wait(30)  # its prefill has begun on the other thread
    gone.cancelled.set()
    for _ in range(3):
        s.step()
    # the prefill may still write them: not back yet
    assert runner.pool.allocator.num_free == free_before - len(gone.block_table)
    gate.go.set()
    after = make_seq(s, prompt(180, 4), 6, PrefillMode.PARTITIONED)
    after.prefill_sms = 32  # the request's own count
    s.submit(after)
    seen = Seen()
    run_until_done(s)
    assert seen(gone) == []
    assert seen.tokens(after) == generate(runner, [prompt(180, 4)], 6)[0]
    assert gate.asked == [64, 32]
    assert runner.pool.allocator.num_free == free_before
    s.local.partitioned.stop()  # type: ignore[union-attr]


@pytest.mark.parametrize("short_first", [True, False])
def test_short_prompts_are_prefilled_between_a_long_prompts_layers_with_short_first(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch,
        short_first: bool) -> None:
    """With short_first, a short prompt queued behind a long one gets its first token before the long one's, and
    a prompt that is not short keeps its place behind the long one; without it, first come, first served. Every
    token is the reference's, and no block is left."""
    monkeypatch.setattr(partitioned, "YIELDING_PROMPT_TOKENS", 300)
    monkeypatch.setattr(partitioned, "SHORT_PROMPT_TOKENS", 100)
    gate = Gated()
    s = started(runner, loop, gate, short_first)
    thread = s.local.partitioned
    assert thread is not None
    done_order: list[str] = []
    post = thread.post

    def recorded(done: partitioned.PrefillDone) -> None:
        done_order.append(done.seq.request_id)
        post(done)

    thread.post = recorded
    lengths = {"long": (500, 9), "middle": (420, 10), "short": (60, 11)}
    seqs = {name: make_seq(s, prompt(n, salt), 6, PrefillMode.PARTITIONED) for name, (n, salt) in lengths.items()}
    s.submit(seqs["long"])
    s.step()
    assert gate.inside.wait(30)  # the long prompt is held at its partition's door
    s.submit(seqs["middle"])
    s.submit(seqs["short"])
    s.step()  # both queued behind it
    gate.go.set()
    seen = Seen()
    run_until_done(s)
    order = ("short", "long", "middle") if short_first else ("long", "middle", "short")
    assert done_order == [seqs[name].request_id for name in order]
    for name, (n, salt) in lengths.items():
        assert seen.tokens(seqs[name]) == generate(runner, [prompt(n, salt)], 6)[0], name
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
    thread.stop()


def test_a_failed_partitioned_prefill_fails_that_request_only(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    gate = Gated()
    s = started(runner, loop, gate)
    a_prompt = prompt(100, 5)
    seen = Seen()
    a = make_seq(s, a_prompt, 12, PrefillMode.COLOCATED)
    s.submit(a)
    b = make_seq(s, prompt(300, 6), 5, PrefillMode.PARTITIONED)
    gate.fail = RuntimeError("CUDA error: the green context is gone")
    s.submit(b)
    gate.go.set()
    run_until_done(s)
    (failure,) = seen(b)
    assert isinstance(failure, Rejected) and "green context is gone" in str(failure)
    assert seen.tokens(a) == generate(runner, [a_prompt], 12)[0]
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
    s.local.partitioned.stop()  # type: ignore[union-attr]


def test_without_green_contexts_a_partitioned_prompt_is_prefilled_by_layers(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4,
                       layer_slice_tokens=300)  # one layer a slice
    seen = Seen()
    a = make_seq(s, prompt(100, 7), 20, PrefillMode.COLOCATED)
    s.submit(a)
    s.step()
    b = make_seq(s, prompt(300, 8), 6, PrefillMode.PARTITIONED)
    s.submit(b)
    for n in range(1, runner.config.num_layers + 1):
        s.step()
        assert len(seen(b)) == (n == runner.config.num_layers)  # B's first token with its last slice
    run_until_done(s)
    assert seen.tokens(b) == generate(runner, [prompt(300, 8)], 6)[0]
    assert seen.tokens(a) == generate(runner, [prompt(100, 7)], 20)[0]
    assert s.check_prefill_sms(3) is None  # no partitions: any count, as the prompt runs layered anyway


def test_a_partition_whose_graphs_fail_to_capture_prefills_eagerly(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Where the partition has a stream of its own but capturing on it fails, the thread says so in one
    line, starts, and prefills eagerly, with the reference tokens."""
    def refuse() -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "partition_graphs", refuse)
    gate = Gated()
    gate.streams_of_their_own = True  # type: ignore[misc]
    with caplog.at_level("WARNING", logger="decode_server.partitioned"):
        s = started(runner, loop, gate)
    assert s.local.partitioned is not None and s.local.partitioned.graphs is None
    assert "could not capture its prefill graphs" in caplog.text
    b_prompt = prompt(200, 4)
    b = make_seq(s, b_prompt, 6, PrefillMode.PARTITIONED)
    s.submit(b)
    gate.go.set()
    run_until_done(s)
    assert Seen().tokens(b) == generate(runner, [b_prompt], 6)[0]
    s.local.partitioned.stop()
