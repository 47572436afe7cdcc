"""Layered prefill in the batch scheduler: a whole prompt's prefill a slice of the model's layers
at a time, one decode step for the running batch between two slices."""

from __future__ import annotations

import asyncio

import pytest

from decode_server.admission import Admission
from decode_server.config import PrefillMode
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import Output, Rejected, RequestSequence, TokenOutput
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(preset="tiny", max_model_len=1024)  # 4 layers



def scheduler(runner: ModelRunner, loop: asyncio.AbstractEventLoop, layer_slice_tokens: int) -> BatchScheduler:
    return BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4,
                          layer_slice_tokens=layer_slice_tokens,
                          overlap_steps=False)  # each step's token counted as it is sampled


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 29 + salt * 7 + 3) % 256 for i in range(n)]


def make_seq(s: BatchScheduler, tokens: list[int], new: int, mode: PrefillMode) -> RequestSequence:
    seq = RequestSequence(f"{mode}-{len(tokens)}", tokens, new, SamplingParams(), frozenset(), frozenset(), mode, 64)
    s.loop.run_until_complete(s.admission.reserve(seq))
    return seq


class Seen:
    """What each sequence has output so far."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[Output]] = {}

    def __call__(self, seq: RequestSequence) -> list[Output]:
        self.outputs.setdefault(seq.request_id, []).extend(seq.out.taken())
        return self.outputs[seq.request_id]

    def tokens(self, seq: RequestSequence) -> list[int]:
        return [o.token_id for o in self(seq) if isinstance(o, TokenOutput)]


def busy(s: BatchScheduler) -> bool:
    return bool(s.running or s.local.prefilling or s.ready or s.num_waiting or s.step_in_flight)


@pytest.mark.parametrize("layers_per_slice", [1, 3])
def test_a_decodes_between_the_slices_of_b_and_both_get_their_tokens(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop, layers_per_slice: int) -> None:
    a_prompt, b_prompt = prompt(120, 1), prompt(300, 2)
    a_alone, b_alone = generate(runner, [a_prompt], 30)[0], generate(runner, [b_prompt], 12)[0]
    s = scheduler(runner, loop, 300 * layers_per_slice)
    seen = Seen()
    a = make_seq(s, a_prompt, 30, PrefillMode.COLOCATED)
    s.submit(a)
    s.step()
    b = make_seq(s, b_prompt, 12, PrefillMode.LAYERED)
    s.submit(b)
    slices = -(-runner.config.num_layers // layers_per_slice)
    for n in range(1, slices + 1):
        s.step()
        assert len(seen.tokens(a)) == 1 + n  # A's step ran after each slice
        assert len(seen(b)) == (n == slices)  # B's first token comes with its last slice
    while busy(s):
        s.step()
    assert seen.tokens(a) == a_alone
    assert seen.tokens(b) == b_alone
    assert not any(isinstance(o, Rejected) for o in seen(a) + seen(b))
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks  # every block back


def test_cancelled_between_slices_frees_its_blocks_and_the_next_prompt_starts_afresh(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    s = scheduler(runner, loop, 200)  # one layer a slice
    free_before = runner.pool.allocator.num_free
    seen = Seen()
    gone = make_seq(s, prompt(200, 3), 8, PrefillMode.LAYERED)
    s.submit(gone)
    s.step()
    s.step()
    assert s.local.layered is not None and s.local.layered.seq is gone
    gone.cancelled.set()
    after = make_seq(s, prompt(180, 4), 6, PrefillMode.LAYERED)
    s.submit(after)
    while busy(s):
        s.step()
    assert seen(gone) == [] and s.local.layered is None
    assert seen.tokens(after) == generate(runner, [prompt(180, 4)], 6)[0]
    assert runner.pool.allocator.num_free == free_before
