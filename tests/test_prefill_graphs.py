"""The prefill graphs' pieces (`engine.prefill_graphs`), run eagerly on the CPU: padded to a bucket,
a prefill gives the eager forward's logits and KV, its padding rows write only the reserved block,
and a transport hears of every layer in order. On CUDA the same pieces are captured
(`tests/test_cuda.py`)."""

from __future__ import annotations

import pytest
import torch

from engine.offline import make_runner
from engine.prefill_graphs import PrefillGraphs
from engine.runner import ModelRunner
from tests.conftest import write_tiny_checkpoint

BUCKETS = (4, 8, 16)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param)
    return make_runner(str(folder), preset=None, max_model_len=256)


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 11 + 5) % 200 for i in range(n)]


def eager_then_pieces(runner: ModelRunner, tokens: list[int], start: int,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The last piece of `tokens` (from `start`) prefilled eagerly into one sequence's blocks and by
    the pieces into another's, each after the same eager prefix: (eager logits, pieces' logits, eager
    KV, pieces' KV, the layers the pieces reported done)."""
    graphs = PrefillGraphs(runner.model, runner.pool, BUCKETS, capture=False)
    pool, n = runner.pool, len(tokens)
    tables = [pool.allocator.allocate(pool.blocks_needed(n)) for _ in range(2)]
    done: list[int] = []
    try:
        if start:
            for table in tables:
                runner.prefill(tokens[:start], table, 0)
        eager = runner.prefill(tokens[start:], tables[0], start)
        pieces = graphs.prefill(tokens[start:], tables[1], start, on_layer_done=done.append)[0]
        kv = [torch.stack([pool.read(layer, pool.slots(table, 0, n)) for layer in range(len(pool.layers))])
              for table in tables]
    finally:
        for table in tables:
            pool.allocator.free(table)
    return eager, pieces, kv[0], kv[1], done


@pytest.mark.parametrize("tokens, start", [(5, 0), (8, 0), (16, 0), (30, 27), (40, 33), (12, 4)])
def test_pieces_give_the_eager_forwards_logits_and_kv(runner: ModelRunner, tokens: int, start: int) -> None:
    eager, pieces, eager_kv, pieces_kv, done = eager_then_pieces(runner, prompt(tokens, tokens + start), start)
    torch.testing.assert_close(pieces, eager, rtol=1e-5, atol=1e-5)
    assert int(pieces.argmax()) == int(eager.argmax())
    torch.testing.assert_close(pieces_kv, eager_kv, rtol=1e-5, atol=1e-5)
    assert done == list(range(len(runner.model.layers)))


def test_padding_rows_write_only_the_reserved_block(runner: ModelRunner) -> None:
    pool = runner.pool
    graphs = PrefillGraphs(runner.model, pool, BUCKETS, capture=False)
    table = pool.allocator.allocate(pool.blocks_needed(5))
    before = [layer.clone() for layer in pool.layers]
    try:
        graphs.prefill(prompt(5, 1), table, 0)  # 5 tokens padded to 8 rows
    finally:
        pool.allocator.free(table)
    block = pool.layout.block_size
    for layer, old in zip(pool.layers, before, strict=True):
        changed = (layer != old).flatten(2).any(-1).any(0).nonzero().flatten().tolist()  # slots that changed
        assert {s // block for s in changed} <= {0, *table}, changed
        assert [s for s in changed if s // block in table] == pool.slots(table, 0, 5).tolist()


def test_a_prompt_longer_than_the_largest_bucket_does_not_fit(runner: ModelRunner) -> None:
    graphs = PrefillGraphs(runner.model, runner.pool, BUCKETS, capture=False)
    assert graphs.fits(16) and not graphs.fits(17) and not graphs.fits(0)
    assert [graphs.bucket_for(t) for t in (1, 4, 5, 9, 16)] == [4, 4, 8, 16, 16]



def test_warm_up_runs_short_prefills_graphed_and_eager(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the runner has prefill graphs, warm-up runs each prefill of up to their largest bucket both
    ways: the partitioned thread's and a prompt's log probabilities run eagerly, and must find their
    kernels compiled too. A longer one, eager either way, runs once."""
    from engine.warmup import WarmUp

    monkeypatch.setattr(runner, "prefill_graphs", PrefillGraphs(runner.model, runner.pool, BUCKETS, capture=False))
    calls: list[tuple[int, int, bool]] = []
    prefill = runner.prefill

    def recorded(tokens: list[int], table: list[int], start: int, graphed: bool = True) -> torch.Tensor:
        calls.append((len(tokens), start, graphed))
        return prefill(tokens, table, start, graphed=graphed)

    monkeypatch.setattr(runner, "prefill", recorded)
    warm = WarmUp(runner)
    warm.whole_prompts()
    warm.chunks([16, 32])
    short = {(n, start) for n, start, _ in calls if n <= BUCKETS[-1]}
    assert short and all((n, start, g) in calls for n, start in short for g in (True, False))
    # a longer prefill is eager either way: it runs once
    assert any(n > BUCKETS[-1] for n, _, _ in calls) and all(g for n, _, g in calls if n > BUCKETS[-1])
