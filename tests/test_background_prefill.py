"""Background prefill in the decode engine: the prompt's prefill is left running beside the decode
steps. On the CPU it runs at once, so here its completion marker is held back by hand to stand for
a prefill still on the GPU's prefill stream."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from decode_server.engine import DecodeEngine
from decode_server.sequence import ErrorEvent, Sequence, TokenEvent
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams


@dataclass
class HeldBack:
    """Stands for the CUDA event recorded after a prefill: done once the test says so."""

    done: bool = False

    def query(self) -> bool:
        return self.done


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return make_runner(preset="tiny", max_model_len=1024)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 29 + salt * 7 + 3) % 256 for i in range(n)]


def make_seq(runner: ModelRunner, tokens: list[int], new: int, mode: str, events: list) -> Sequence:  # type: ignore[type-arg]
    seq = Sequence(f"{mode}-{len(tokens)}", tokens, new, SamplingParams(), frozenset(), frozenset(), mode, 64,
                   events.append)
    seq.block_table = runner.pool.allocator.allocate(runner.pool.blocks_needed(seq.total_tokens))
    return seq


def tokens_of(events: list) -> list[int]:  # type: ignore[type-arg]
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def held_back_start(engine: DecodeEngine) -> HeldBack:
    """Step until the engine has queued the background prefill; hold its end back."""
    for _ in range(3):
        engine.step()
        if engine.background is not None:
            break
    assert engine.background is not None
    marker = HeldBack()
    engine.background.done = marker
    return marker


def test_decoding_goes_on_while_the_prompt_prefills_beside(runner: ModelRunner) -> None:
    a_prompt, b_prompt = prompt(120, 1), prompt(300, 2)
    a_alone, b_alone = (generate(runner, [p], n)[0] for p, n in ((a_prompt, 30), (b_prompt, 12)))
    engine = DecodeEngine(runner, max_batch_size=4)
    a_events: list = []  # type: ignore[type-arg]
    b_events: list = []  # type: ignore[type-arg]
    engine.submit(make_seq(runner, a_prompt, 30, "colocated", a_events))
    engine.step()
    engine.submit(make_seq(runner, b_prompt, 12, "background", b_events))
    marker = held_back_start(engine)
    before = len(tokens_of(a_events))
    for _ in range(5):
        engine.step()
    assert len(tokens_of(a_events)) == before + 5  # A got a token every step
    assert b_events == []                          # B waits for its prefill
    marker.done = True
    while engine.running or engine.background or engine.ready:
        engine.step()
    assert tokens_of(a_events) == a_alone
    assert tokens_of(b_events) == b_alone
    assert not any(isinstance(e, ErrorEvent) for e in a_events + b_events)
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks  # every block back


def test_cancelled_while_prefilling_frees_its_blocks_only_when_the_prefill_is_done(runner: ModelRunner) -> None:
    engine = DecodeEngine(runner, max_batch_size=4)
    events: list = []  # type: ignore[type-arg]
    seq = make_seq(runner, prompt(200, 3), 8, "background", events)
    free_before = runner.pool.allocator.num_free
    engine.submit(seq)
    marker = held_back_start(engine)
    seq.cancelled.set()
    for _ in range(3):
        engine.step()
    assert runner.pool.allocator.num_free == free_before  # the prefill may still write them
    marker.done = True
    engine.step()
    assert engine.background is None
    assert runner.pool.allocator.num_free == free_before + len(seq.block_table)
    assert events == []  # nothing is sent to a cancelled request
