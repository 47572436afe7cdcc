"""Partitioned prefill on the device: B's prefill in a green context beside A's CUDA-graph decode
steps on the primary context. Skipped where there is no GPU (the CPU's version of the thread is
in test_partitioned_prefill.py); where torch or the driver has no green contexts, skipped with the
reason the server would log."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _no_green_contexts() -> str | None:
    from engine.green_context import unavailable

    return unavailable(torch.device("cuda:0"))


@pytest.fixture(scope="module")
def partitions():  # type: ignore[no-untyped-def]
    from engine.green_context import GreenContexts

    reason = _no_green_contexts()
    if reason:
        pytest.skip(reason)
    return GreenContexts(torch.device("cuda:0"))


def half_the_sms(partitions) -> int:  # type: ignore[no-untyped-def]
    from engine.green_context import split_granularity

    _, step = split_granularity(partitions.capability[0])
    return (partitions.total_sms // 2) // step * step


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    from engine.offline import make_runner

    return make_runner(preset="qwen2.5-7b", device="cuda:0", dtype=torch.bfloat16, max_batch_size=4,
                       max_model_len=20000, kv_gb=4.0, cuda_graphs=True)



def test_confined_work_runs_on_the_green_stream_and_computes_the_same(partitions) -> None:  # type: ignore[no-untyped-def]
    n = half_the_sms(partitions)
    assert partitions.check(n) is None and partitions.check(n + 1) is not None
    x = torch.randn(2048, 2048, device="cuda:0", dtype=torch.bfloat16)
    outside = torch.cuda.current_stream()
    expected = x @ x
    with partitions.confine(n):
        assert torch.cuda.current_stream() != outside
        inside = x @ x
        torch.cuda.current_stream().synchronize()
    assert torch.equal(inside, expected)


def test_a_decodes_with_its_graphs_while_b_prefills_in_a_green_context(runner, partitions, loop) -> None:  # type: ignore[no-untyped-def]
    """A's tokens are A's alone and B's the whole-prompt reference; A keeps stepping through B's
    prefill, none of its steps anywhere near as long as that prefill."""
    from decode_server.admission import Admission
    from decode_server.config import PrefillMode
    from decode_server.scheduler import BatchScheduler
    from decode_server.sequence import RequestSequence, TokenOutput
    from engine.offline import generate
    from engine.sampling import SamplingParams

    a_prompt = [(i * 7) % 1000 for i in range(1024)]
    b_prompt = [(i * 11 + 3) % 1000 for i in range(16384)]
    a_alone, b_alone = generate(runner, [a_prompt], 120)[0], generate(runner, [b_prompt], 8)[0]
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, partitions=partitions,
                       prefill_sms=half_the_sms(partitions))
    s.start()
    try:
        seqs: dict[str, RequestSequence] = {}

        def submit(name: str, tokens: list[int], new: int, mode: PrefillMode) -> RequestSequence:
            seq = seqs[name] = RequestSequence(name, tokens, new, SamplingParams(), frozenset(), frozenset(), mode, 512)
            loop.run_until_complete(s.admission.reserve(seq))
            s.submit(seq)
            return seq

        a = submit("a", a_prompt, 120, PrefillMode.COLOCATED)
        while len(a.tokens) < 20:
            time.sleep(0.001)
        b_sent = time.perf_counter()
        b = submit("b", b_prompt, 8, PrefillMode.PARTITIONED)
        while not b.tokens:
            time.sleep(0.0005)
        b_prefill_s = time.perf_counter() - b_sent
        a_tokens_by_b_first = len(a.tokens)
        while not (a.finish_reason and b.finish_reason):
            time.sleep(0.005)
    finally:
        s.stop()
    outs = {name: [o for o in seq.out.taken() if isinstance(o, TokenOutput)] for name, seq in seqs.items()}
    assert [o.token_id for o in outs["a"]] == a_alone
    assert [o.token_id for o in outs["b"]] == b_alone
    assert a_tokens_by_b_first > 25, "A did not decode while B prefilled"
    a_steps = [o.step_s for o in outs["a"][1:]]
    print(f"B's prefill {b_prefill_s * 1e3:.0f} ms; A's longest step {max(a_steps) * 1e3:.1f} ms, "
          f"{a_tokens_by_b_first - 20} of its tokens during B's prefill")
    assert max(a_steps) < b_prefill_s / 2  # no step waited for the whole prefill
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks


def test_cancelled_mid_prefill_frees_its_blocks_after_the_green_kernels(runner, partitions, loop) -> None:  # type: ignore[no-untyped-def]
    from decode_server.admission import Admission
    from decode_server.config import PrefillMode
    from decode_server.scheduler import BatchScheduler
    from decode_server.sequence import RequestSequence, TokenOutput
    from engine.offline import generate
    from engine.sampling import SamplingParams

    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, partitions=partitions,
                       prefill_sms=half_the_sms(partitions))
    assert s.local.partitioned is not None
    s.local.partitioned.start()  # the test steps the scheduler itself
    try:
        free = runner.pool.allocator.num_free
        gone = RequestSequence("gone", [(i * 5) % 1000 for i in range(16384)], 8, SamplingParams(), frozenset(),
                        frozenset(), PrefillMode.PARTITIONED, 512)
        loop.run_until_complete(s.admission.reserve(gone))
        s.submit(gone)
        s.step()
        assert s.local.in_partition == [gone]
        gone.cancelled.set()
        s.step()
        if s.local.in_partition:  # still prefilling: the blocks wait for its kernels
            assert runner.pool.allocator.num_free == free - len(gone.block_table)
        deadline = time.perf_counter() + 60
        while s.local.in_partition and time.perf_counter() < deadline:
            s.step()
        assert not s.local.in_partition and runner.pool.allocator.num_free == free
        after = RequestSequence("after", [(i * 3) % 1000 for i in range(2000)], 6, SamplingParams(), frozenset(),
                         frozenset(), PrefillMode.PARTITIONED, 512)
        loop.run_until_complete(s.admission.reserve(after))
        s.submit(after)
        while not after.finish_reason:
            s.step()
        assert [o.token_id for o in after.out.taken() if isinstance(o, TokenOutput)] == \
            generate(runner, [list(after.prompt)], 6)[0]
    finally:
        s.local.partitioned.stop()
