"""Partitioned prefill on the device: B's prefill in a green context beside A's CUDA-graph decode
steps on the primary context. Skipped where there is no GPU (the CPU's version of the thread is
in test_partitioned_prefill.py); where torch or the driver has no green contexts, skipped with the
reason the server would log."""

from __future__ import annotations

import time

import pytest
import torch
import triton
import triton.language as tl

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@triton.jit
def sm_ids(out, busy, SPIN: tl.constexpr):  # type: ignore[no-untyped-def]
    """Each program stores the SM it runs on, after a few microseconds of work, so that a launch of many
    programs spreads over every SM it may use."""
    zero = tl.zeros([1], dtype=tl.int32)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32, is_pure=False, pack=1)
    acc = tl.zeros([1], dtype=tl.float32) + tl.program_id(0)
    for _ in range(SPIN):
        acc = acc * 1.0001 + 0.5
    tl.store(out + tl.program_id(0) + tl.arange(0, 1), sm)
    tl.store(busy + tl.program_id(0) + tl.arange(0, 1), acc)


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


def test_a_graph_captured_on_a_green_stream_keeps_to_its_sms(partitions) -> None:  # type: ignore[no-untyped-def]
    """Each program of a kernel records the SM it ran on: eagerly on every SM, and on no more than the
    partition's, eagerly or replayed as a graph captured on the partition's stream."""
    from engine.cuda_graphs import capture

    if not partitions.streams_of_their_own:
        pytest.skip("this torch's green contexts have no streams of their own: partitions run eagerly")

    programs = 8 * partitions.total_sms
    out = torch.full((programs,), -1, dtype=torch.int32, device="cuda:0")
    busy = torch.zeros(programs, device="cuda:0")

    def run() -> None:
        sm_ids[(programs,)](out, busy, SPIN=4096)

    def used() -> int:
        torch.cuda.current_stream().synchronize()
        assert int(out.min()) >= 0
        n = len(set(out.tolist()))
        out.fill_(-1)
        torch.cuda.current_stream().synchronize()
        return n

    run()
    everywhere = used()
    outside = capture(run, torch.device("cuda:0"))  # on the primary context's capture stream
    used()
    share = 16
    with partitions.confine(share):
        run()
        eager = used()
        graph = capture(run, torch.device("cuda:0"), stream=torch.cuda.current_stream())
        used()
        graph.replay()
        replayed = used()
        outside.replay()
        crossed = used()
    print(f"SMs used: {everywhere} on the primary context; in a {share}-SM partition {eager} eagerly, "
          f"{replayed} replaying a graph captured there, {crossed} replaying one captured outside")
    assert everywhere > share
    assert 0 < eager <= share and 0 < replayed <= share


def test_partition_graphs_match_the_engine_graphs(runner, partitions) -> None:  # type: ignore[no-untyped-def]
    """The prefill graphs a partition captures on its stream give the engine thread's graphed prefill,
    whole prompts and a chunk after a cached prefix alike, and replay there; released, they are gone."""
    if not partitions.streams_of_their_own:
        pytest.skip("this torch's green contexts have no streams of their own: partitions run eagerly")
    n = half_the_sms(partitions)
    with partitions.confine(n):
        graphs = runner.partition_graphs()
        assert graphs is not None and graphs is not runner.prefill_graphs and graphs is runner.partition_graphs()
    try:
        _match_the_engine_graphs(runner, partitions, graphs, n)
    finally:
        runner.release_partition_graphs(graphs)  # before the green context can go
    assert not graphs.fits(5)


def _match_the_engine_graphs(runner, partitions, graphs, n: int) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import rel_err

    pool, last = runner.pool, runner.config.num_layers - 1
    gen = torch.Generator().manual_seed(11)
    for prefix, new in [(0, 5), (0, 300), (0, 384), (1000, 64)]:
        tokens = torch.randint(0, 256, (prefix + new,), generator=gen).tolist()
        tables = [pool.allocator.allocate(pool.blocks_needed(prefix + new)) for _ in range(2)]
        if prefix:
            for table in tables:
                runner.prefill(tokens[:prefix], table, 0, graphed=False)
        engine = runner.prefill(tokens[prefix:], tables[0], prefix)
        replays = graphs.replays
        with partitions.confine(n):
            confined = runner.prefill(tokens[prefix:], tables[1], prefix, graphed=graphs)
            torch.cuda.current_stream().synchronize()
        assert graphs.replays == replays + 1
        kv = [pool.read(last, pool.slots(table, prefix, prefix + new)).float() for table in tables]
        for table in tables:
            pool.allocator.free(table)
        assert rel_err(confined, engine) < 1e-2, (prefix, new)
        assert rel_err(kv[1], kv[0]) < 1e-2, (prefix, new)
        assert int(confined.argmax()) == int(engine.argmax()), (prefix, new)
    table = pool.allocator.allocate(pool.blocks_needed(100))
    try:
        with pytest.raises(RuntimeError, match="stream they were captured on"):
            runner.prefill(tokens[:100], table, 0, graphed=graphs)
    finally:
        pool.allocator.free(table)


def test_the_partitioned_thread_replays_its_graphs_for_short_prompts(runner, partitions, loop) -> None:  # type: ignore[no-untyped-def]
    """A short partitioned prompt on the server's SM count replays the thread's own graphs and gives the
    colocated tokens; one on another count runs eagerly, with the same tokens."""
    from decode_server.admission import Admission
    from decode_server.config import PrefillMode
    from decode_server.scheduler import BatchScheduler
    from decode_server.sequence import RequestSequence, TokenOutput
    from engine.offline import generate
    from engine.sampling import SamplingParams

    n = half_the_sms(partitions)
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, partitions=partitions,
                       prefill_sms=n)
    thread = s.local.partitioned
    assert thread is not None
    s.start()
    try:
        if partitions.streams_of_their_own:
            assert thread.graphs is not None
        prompt = [(i * 13 + 1) % 1000 for i in range(300)]
        reference = generate(runner, [prompt], 6)[0]
        for name, sms in (("own", 0), ("other", n - 8)):
            replays = thread.graphs.replays if thread.graphs is not None else 0
            seq = RequestSequence(name, prompt, 6, SamplingParams(), frozenset(), frozenset(), PrefillMode.PARTITIONED,
                                  512, prefill_sms=sms)
            loop.run_until_complete(s.admission.reserve(seq))
            s.submit(seq)
            deadline = time.perf_counter() + 60
            while not seq.finish_reason and time.perf_counter() < deadline:
                time.sleep(0.005)
            assert [o.token_id for o in seq.out.taken() if isinstance(o, TokenOutput)] == reference, name
            if thread.graphs is not None:
                assert thread.graphs.replays == replays + (sms == 0), name
    finally:
        s.stop()
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks


def test_a_short_prompt_is_prefilled_between_the_layers_of_a_long_one(runner, partitions, loop) -> None:  # type: ignore[no-untyped-def]
    """With --partitioned-short-first, a 300-token prompt sent just after a 16k one gets its first token long
    before the 16k one's, from the thread's graphs between the long prompt's layers; both get their reference
    tokens."""
    from decode_server.admission import Admission
    from decode_server.config import PrefillMode
    from decode_server.scheduler import BatchScheduler
    from decode_server.sequence import RequestSequence, TokenOutput
    from engine.offline import generate
    from engine.sampling import SamplingParams

    long_prompt = [(i * 17 + 5) % 1000 for i in range(16384)]
    short_prompt = [(i * 19 + 2) % 1000 for i in range(300)]
    long_ref, short_ref = generate(runner, [long_prompt], 6)[0], generate(runner, [short_prompt], 6)[0]
    s = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4, partitions=partitions,
                       prefill_sms=half_the_sms(partitions), partitioned_short_first=True)
    thread = s.local.partitioned
    assert thread is not None
    s.start()
    try:
        seqs = {name: RequestSequence(name, tokens, 6, SamplingParams(), frozenset(), frozenset(),
                                      PrefillMode.PARTITIONED, 512)
                for name, tokens in (("long", long_prompt), ("short", short_prompt))}
        sent = time.perf_counter()
        for seq in seqs.values():
            loop.run_until_complete(s.admission.reserve(seq))
            s.submit(seq)
        first: dict[str, float] = {}
        deadline = sent + 120
        while len(first) < 2 and time.perf_counter() < deadline:
            for name, seq in seqs.items():
                if seq.tokens and name not in first:
                    first[name] = time.perf_counter() - sent
            time.sleep(0.0005)
        while not all(seq.finish_reason for seq in seqs.values()) and time.perf_counter() < deadline:
            time.sleep(0.005)
    finally:
        s.stop()
    outs = {name: [o.token_id for o in seq.out.taken() if isinstance(o, TokenOutput)] for name, seq in seqs.items()}
    assert outs["long"] == long_ref and outs["short"] == short_ref
    print(f"first tokens: short {first['short'] * 1e3:.0f} ms, long {first['long'] * 1e3:.0f} ms")
    assert first["short"] < first["long"] / 4, first
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
