"""Overlapped decode steps: each step is queued before the last one's tokens are read back, its
rows taking those tokens on the device. A request's tokens are the same as with one step at a
time, whether it ends by length, on a stop or EOS token, sampled or greedy; a sequence that ends
or is cancelled while a step that writes its KV is queued keeps its blocks until that step is
read; and every block goes back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from decode_server.admission import Admission
from decode_server.config import PrefillMode
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import Rejected, RequestSequence, TokenOutput
from engine.host_read import TokenReader
from engine.offline import generate, make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    """The eager CPU path, and on a GPU the CUDA graphs: their two sides of buffers, the feed inside
    the graph, sampled tokens gathered into the graph's buffer."""
    if request.param == "cpu":
        return make_runner(preset="tiny", max_model_len=1024)
    return make_runner(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_model_len=1024, cuda_graphs=True)



def prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def busy(s: BatchScheduler) -> bool:
    return bool(s.running or s.local.prefilling or s.ready or s.num_waiting or s.step_in_flight)


def submit(s: BatchScheduler, name: str, tokens: list[int], new: int, params: SamplingParams | None = None,
           stop: frozenset[int] = frozenset(), eos: frozenset[int] = frozenset()) -> RequestSequence:
    seq = RequestSequence(name, tokens, new, params or SamplingParams(), stop, eos, PrefillMode.COLOCATED, 64)
    s.loop.run_until_complete(s.admission.reserve(seq))
    s.submit(seq)
    return seq


def tokens_of(seq: RequestSequence) -> tuple[list[int], str]:
    outs = seq.out.taken()
    assert not any(isinstance(o, Rejected) for o in outs)
    toks = [o for o in outs if isinstance(o, TokenOutput)]
    return [o.token_id for o in toks], toks[-1].finish_reason


def serve(runner: ModelRunner, loop: asyncio.AbstractEventLoop, overlap: bool,
          stop_token: int, eos_token: int) -> dict[str, tuple[list[int], str]]:
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, overlap_steps=overlap)
    seqs = [submit(s, "length", prompt(50, 1), 12),
            submit(s, "stop", prompt(70, 2), 40, stop=frozenset({stop_token})),
            submit(s, "eos", prompt(30, 3), 40, eos=frozenset({eos_token})),
            submit(s, "sampled", prompt(40, 4), 15, SamplingParams(temperature=0.8, top_k=20, seed=7))]
    for i in range(200):
        if not busy(s):
            break
        s.step()
        if i == 3:  # one arrives while the others decode, and one more with a single token to give
            seqs.append(submit(s, "late", prompt(20, 5), 6))
            seqs.append(submit(s, "one", prompt(25, 6), 1))
    assert not busy(s)
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks  # every block back
    return {seq.request_id: tokens_of(seq) for seq in seqs}


def test_overlapped_steps_give_every_request_the_tokens_of_one_step_at_a_time(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    alone = generate(runner, [prompt(70, 2), prompt(30, 3)], 40)
    stop_token, eos_token = alone[0][9], alone[1][4]  # each ends a request early, mid-batch
    one_at_a_time = serve(runner, loop, False, stop_token, eos_token)
    overlapped = serve(runner, loop, True, stop_token, eos_token)
    assert overlapped == one_at_a_time
    assert one_at_a_time["stop"][1] == "stop" and len(one_at_a_time["stop"][0]) <= 10
    assert one_at_a_time["eos"][1] == "eos" and len(one_at_a_time["eos"][0]) <= 5
    assert one_at_a_time["length"] == (generate(runner, [prompt(50, 1)], 12)[0], "length")


def test_a_sequence_leaving_while_its_next_step_is_queued_keeps_its_blocks_until_that_step_is_read(
        runner: ModelRunner, loop: asyncio.AbstractEventLoop) -> None:
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, overlap_steps=True)
    allocator = runner.pool.allocator
    free_at_read: list[int] = []

    class Watching(TokenReader):
        def take(self) -> list[int]:
            free_at_read.append(allocator.num_free)
            return super().take()

    s.decode.readers = [Watching(runner.device), Watching(runner.device)]
    stays = submit(s, "stays", prompt(60, 7), 30)
    leaves = submit(s, "leaves", prompt(90, 8), 30)
    held = len(leaves.block_table)
    for _ in range(4):  # both prefilled, and decoding with a step queued
        s.step()
    assert s.step_in_flight and leaves in s.running
    leaves.cancelled.set()
    free = allocator.num_free
    s.step()  # dropped before the next step is queued; the step queued before writes its KV still
    assert free_at_read[-1] == free  # its blocks were held until that step was read
    assert leaves not in s.running and allocator.num_free == free + held  # and given back right after
    while busy(s):
        s.step()
    assert tokens_of(stays)[0] == generate(runner, [prompt(60, 7)], 30)[0]
    assert allocator.num_free == allocator.num_blocks
