"""Layered prefill in the decode engine: a whole prompt's prefill a slice of the model's layers at
a time, one decode step for the running batch between two slices."""

from __future__ import annotations

import pytest

from decode_server.engine import DecodeEngine
from decode_server.sequence import ErrorEvent, Sequence, TokenEvent
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(preset="tiny", max_model_len=1024)  # 4 layers


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 29 + salt * 7 + 3) % 256 for i in range(n)]


def make_seq(runner: ModelRunner, tokens: list[int], new: int, mode: str, events: list) -> Sequence:  # type: ignore[type-arg]
    seq = Sequence(f"{mode}-{len(tokens)}", tokens, new, SamplingParams(), frozenset(), frozenset(), mode, 64,
                   events.append)
    seq.block_table = runner.pool.allocator.allocate(runner.pool.blocks_needed(seq.total_tokens))
    return seq


def tokens_of(events: list) -> list[int]:  # type: ignore[type-arg]
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("layers_per_slice", [1, 3])
def test_a_decodes_between_the_slices_of_b_and_both_get_their_tokens(runner: ModelRunner,
                                                                     layers_per_slice: int) -> None:
    a_prompt, b_prompt = prompt(120, 1), prompt(300, 2)
    a_alone, b_alone = generate(runner, [a_prompt], 30)[0], generate(runner, [b_prompt], 12)[0]
    engine = DecodeEngine(runner, max_batch_size=4, layer_slice_tokens=300 * layers_per_slice)
    a_events: list = []  # type: ignore[type-arg]
    b_events: list = []  # type: ignore[type-arg]
    engine.submit(make_seq(runner, a_prompt, 30, "colocated", a_events))
    engine.step()
    engine.submit(make_seq(runner, b_prompt, 12, "layered", b_events))
    slices = -(-runner.config.num_layers // layers_per_slice)
    for n in range(1, slices + 1):
        engine.step()
        assert len(tokens_of(a_events)) == 1 + n  # A's step ran after each slice
        assert len(b_events) == (n == slices)     # B's first token comes with its last slice
    while engine.running or engine.prefilling or engine.ready:
        engine.step()
    assert tokens_of(a_events) == a_alone
    assert tokens_of(b_events) == b_alone
    assert not any(isinstance(e, ErrorEvent) for e in a_events + b_events)
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks  # every block back


def test_cancelled_between_slices_frees_its_blocks_and_the_next_prompt_starts_afresh(runner: ModelRunner) -> None:
    engine = DecodeEngine(runner, max_batch_size=4, layer_slice_tokens=200)  # one layer a slice
    free_before = runner.pool.allocator.num_free
    gone_events: list = []  # type: ignore[type-arg]
    gone = make_seq(runner, prompt(200, 3), 8, "layered", gone_events)
    engine.submit(gone)
    engine.step()
    engine.step()
    assert engine.layered is not None and engine.layered.seq is gone
    gone.cancelled.set()
    next_events: list = []  # type: ignore[type-arg]
    engine.submit(make_seq(runner, prompt(180, 4), 6, "layered", next_events))
    while engine.running or engine.prefilling or engine.ready:
        engine.step()
    assert gone_events == [] and engine.layered is None
    assert tokens_of(next_events) == generate(runner, [prompt(180, 4)], 6)[0]
    assert runner.pool.allocator.num_free == free_before
