"""Later turns: `bench.micro.engine_steps --later-turns` on the CPU's tiny model, and the planner's fit of its rows."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.micro import engine_steps as engine
from bench.micro.later_turns import LaterTurns
from engine.offline import make_runner
from planner.costs import GRAPHED_TOKENS, LATER_TURNS, RESULTS, Costs
from planner.fits import fit_costs, fit_later_turn, later_turn_rows

TRUE = (4.0, 0.03, 0.0004, 2e-6)  # f0 ms, ms a new token, ms a prefix token, ms a new token's attention token


def test_bench_engine_times_later_turns_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "later.json"
    monkeypatch.setattr(sys, "argv", ["bench/micro/engine_steps.py", "--later-turns", "--preset", "tiny",
                                      "--device", "cpu",
                                      "--prefix-lens", "32", "64", "--new-lens", "16", "40",
                                      "--later-turn-batches", "0", "2", "--context", "24", "--repeats", "1",
                                      "--json", str(out)])
    engine.main()
    doc = json.loads(out.read_text())
    assert doc["preset"] == "tiny" and doc["device"] == "cpu"
    assert doc["command"].startswith("python -m bench.micro.engine_steps")
    rows = doc["later_turns"]
    assert [(r["batch"], r["prefix"], r["new"]) for r in rows] == [
        (b, p, n) for b in (0, 2) for p in (32, 64) for n in (16, 40)]
    for row in rows:
        assert row["ms"] > 0 and row["min_ms"] <= row["ms"] and row["repeats"] == 1
        if row["batch"]:
            assert row["context"] == 24 and row["gap_ms"] > 0 and row["step_ms"] > 0


def test_later_turns_profile_the_host_on_the_pool_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--profile` with `--later-turns` records one more turn a row under cProfile; `--kv-cache-dtype` sets the
    pool the turns run on (both were taken and ignored in that mode once)."""
    from bench.micro.later_turns import COSTLIEST

    out = tmp_path / "later.json"
    monkeypatch.setattr(sys, "argv", ["bench/micro/engine_steps.py", "--later-turns", "--preset", "tiny",
                                      "--device", "cpu", "--prefix-lens", "32", "--new-lens", "16",
                                      "--later-turn-batches", "0", "--repeats", "1", "--profile",
                                      "--kv-cache-dtype", "fp8", "--json", str(out)])
    engine.main()
    doc = json.loads(out.read_text())
    assert doc["kv_cache_dtype"] == "float8_e4m3fn"
    (row,) = doc["later_turns"]
    host = row["host"]
    assert 0 < host["queued_ms"] <= host["ms"]
    assert host["triton_launches"] == 0  # the CPU runs the PyTorch ops
    own = [f["self_ms"] for f in host["costliest"]]
    assert 0 < len(own) <= COSTLIEST and own == sorted(own, reverse=True)
    assert any(f["function"].startswith(("ops.py", "decoder.py")) for f in host["costliest"])  # the forward's own


@pytest.mark.parametrize(("argv", "named"), [
    (["--later-turns", "--batches", "8", "--steps", "5"], "--batches, --steps"),
    (["--prefix-lens", "32", "--device", "cpu"], "--prefix-lens, --device")])
def test_engine_steps_refuses_the_other_modes_flags(argv: list[str], named: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag of the decode-and-prefill run given with --later-turns, or a later-turn flag without it, is refused
    in one line before anything is built, not ignored."""
    monkeypatch.setattr(sys, "argv", ["bench/micro/engine_steps.py", "--preset", "tiny", *argv])
    with pytest.raises(SystemExit) as exit_:
        engine.main()
    message = str(exit_.value.code)
    assert message.startswith(f"error: {named}:") and "\n" not in message


def test_later_turns_on_a_share_of_the_sms_are_marked_and_not_fitted() -> None:
    from bench.micro.later_turns import measure
    from engine.green_context import Unconfined

    runner = make_runner(preset="tiny")
    rows = measure(runner, [32], [8, 16], [0], context=16, repeats=1, partitions=Unconfined(), sms=8)
    assert [r["sms"] for r in rows] == [8, 8] and all(r["ms"] > 0 for r in rows)
    with pytest.raises(ValueError, match="alone"):
        measure(runner, [32], [8], [0, 2], context=16, repeats=1, partitions=Unconfined(), sms=8)
    confined = [{"prefix": p, "new": c, "batch": 0, "ms": 50.0, "sms": 72}
                for p in (1024, 4096) for c in (64, 128, 256)]
    assert fit_later_turn(confined) is None  # the fit takes the turns on every SM only


def test_a_later_turn_finds_its_prefix_in_the_cache() -> None:
    runner = make_runner(preset="tiny")
    turns = LaterTurns(runner)
    turns.first_turn(48)
    free = runner.pool.allocator.num_free
    ms, gap = turns.turn_ms(48, 5)  # raises unless the cache gave all 48 tokens
    assert ms > 0 and gap is None
    assert runner.pool.allocator.num_free == free  # the turn's own block went back; the prefix stays cached
    with pytest.raises(ValueError, match="whole blocks"):
        turns.first_turn(20)


def _results_with(tmp_path: Path, rows: list[dict[str, Any]], preset: str = "qwen2.5-7b") -> Path:
    tmp_path.mkdir(exist_ok=True)
    for path in RESULTS.glob("*.json"):
        if path.name != LATER_TURNS:  # written below: a link would write through to the recorded file
            (tmp_path / path.name).symlink_to(path)
    (tmp_path / LATER_TURNS).write_text(json.dumps({"preset": preset, "later_turns": rows}))
    return tmp_path


def _synthetic_rows() -> list[dict[str, Any]]:
    """Turns alone priced by TRUE, then the same beside a batch of 32: the turn alone, a 12 ms step and 3 ms more."""
    f0, f1, f2, f3 = TRUE
    alone = [(p, c, f0 + f1 * c + f2 * p + f3 * c * (p + c / 2)) for p in (1024, 4096, 16384)
             for c in (64, 128, 256, 400)]
    return [*({"prefix": p, "new": c, "batch": 0, "ms": ms} for p, c, ms in alone),
            *({"prefix": p, "new": c, "batch": 32, "ms": 500.0, "step_ms": 12.0, "gap_ms": ms + 15.0}
              for p, c, ms in alone)]


def test_the_later_turn_fit_prices_prefills_after_a_cached_prefix(tmp_path: Path) -> None:
    results = _results_with(tmp_path, _synthetic_rows())
    fit = fit_later_turn(later_turn_rows(results))
    assert fit is not None and fit.points == 12
    assert fit.params == pytest.approx(TRUE, rel=1e-6) and fit.r2 > 0.9999 and fit.max_rel_error < 1e-6
    costs = fit_costs(results)
    assert costs.later_turn == fit and fit in costs.fits()
    (beside,) = costs.later_turn_beside
    assert beside in costs.fits() and "batch 32" in beside.name and beside.points == 12
    assert beside.params == pytest.approx((3.0,)) and beside.max_rel_error < 1e-9
    f0, f1, f2, f3 = TRUE
    turn = f0 + f1 * 200 + f2 * 8192 + f3 * 200 * (8192 + 100)
    assert costs.prefill_ms(200, 8192) == pytest.approx(turn)  # graphed, as the timed turns: the fit alone
    # a turn longer than the prefill graphs take runs eagerly: at least a chunk of it; a graphed one the fit
    fast = dataclasses.replace(costs, later_turn=dataclasses.replace(fit, params=(1.0, 0.0, 0.0, 0.0)))
    assert fast.prefill_ms(2048, 4096) == fast.chunk_ms(2048, 4096) > 1.0
    assert fast.prefill_ms(GRAPHED_TOKENS, 4096) == 1.0 < fast.chunk_ms(GRAPHED_TOKENS, 4096)
    factor = costs.local_factor.params[0]
    assert costs.local_prefill_ms(200, 8192) == pytest.approx(costs.prefill_ms(200, 8192) * factor)
    # chunked: the first chunk after a hit is the colocated later turn's engine call; later chunks the chunk fit's
    assert costs.chunk_piece_ms(512, 4096, 4096) == costs.local_prefill_ms(512, 4096)
    assert costs.chunk_piece_ms(512, 4608, 4096) == costs.chunk_ms(512, 4608)
    assert costs.chunk_piece_ms(512, 0, 0) == costs.chunk_ms(512, 0)
    # a whole prompt is the prefill fit's, as before
    assert costs.prefill_ms(4096) == fit_costs().prefill_ms(4096)
    # on a share of the SMs (partitioned) a graphed turn is the fit with its token terms slowed by the share; a
    # longer, eager one a chunk of it slowed by the share, held at least at the fit
    assert costs.prefill_on_share_ms(200, 8192, 0.5) == pytest.approx(f0 + (turn - f0) / 0.5)
    long_turn = f0 + f1 * 2048 + f2 * 8192 + f3 * 2048 * (8192 + 1024)
    assert costs.prefill_on_share_ms(2048, 8192, 0.5) == pytest.approx(max(long_turn, costs.chunk_ms(2048, 8192) / 0.5))
    assert costs.prefill_on_share_ms(4096, 0, 0.5) == pytest.approx(costs.prefill_ms(4096) / 0.5)
    assert bare_share(costs) == pytest.approx(costs.chunk_ms(200, 8192) / 0.5)


def bare_share(costs: Costs) -> float:
    """Without timed later turns a cached prefill is one chunk, all of it GPU work slowed by the share."""
    return dataclasses.replace(costs, later_turn=None).prefill_on_share_ms(200, 8192, 0.5)


def test_no_later_turn_term_is_negative() -> None:
    """Turns that cost the same at every length (bound by the host's launches) fit a fixed part alone: a term
    the noise makes negative is dropped and the rest refitted, so no longer turn is priced cheaper."""
    noise = (0.9, 1.1, 1.05, 0.95)
    rows = [{"prefix": p, "new": c, "batch": 0, "ms": 33.0 * noise[(i + j) % 4] + 0.001 * (c - 200) * (-1) ** j}
            for i, p in enumerate((1024, 4096, 16384)) for j, c in enumerate((64, 128, 256, 400))]
    fit = fit_later_turn(rows)
    assert fit is not None and all(p >= 0 for p in fit.params) and fit.params[0] > 25


def test_without_later_turns_a_cached_prefill_is_one_chunk(tmp_path: Path) -> None:
    costs = fit_costs()
    if costs.later_turn is None:  # the recorded results hold no later turns yet
        assert costs.prefill_ms(200, 8192) == costs.chunk_ms(200, 8192)
    bare = dataclasses.replace(costs, later_turn=None)
    assert bare.prefill_ms(200, 8192) == bare.chunk_ms(200, 8192)
    assert bare.chunk_piece_ms(512, 4096, 4096) == bare.chunk_ms(512, 4096)
    # rows of another shape (a CPU run of the tiny model), or too few to fix the four terms, are not fitted
    assert later_turn_rows(_results_with(tmp_path / "tiny", _synthetic_rows(), preset="tiny")) == []
    assert fit_later_turn(_synthetic_rows()[:4]) is None


def test_the_decode_loop_reads_the_same_tokens_overlapped_or_not() -> None:
    """The benchmarks' decode loop (bench.micro.engine_steps's step, the later turns' running batch): queued before
    the last step's tokens are read back, its rows fed those tokens on the device, it reads back what the
    plain loop reads, a step later."""
    from bench.micro.decode_loop import DecodeLoop

    reads: dict[bool, list[list[int]]] = {}
    for overlap in (True, False):
        runner = make_runner(preset="tiny")
        tables = [runner.pool.allocator.allocate(runner.pool.blocks_needed(40)) for _ in range(3)]
        for i, table in enumerate(tables):
            runner.prefill([(7 * i + j) % 200 for j in range(16 + 5 * i)][-16:], table, 0)
        loop = DecodeLoop(runner, tables, 16, overlap)
        reads[overlap] = [list(loop.last) for _ in range(8) if loop.step()]
    assert len(reads[False]) == 8 and len(reads[True]) == 7
    assert reads[True] == reads[False][:7]


def test_bench_engine_times_decode_steps_on_the_cpu() -> None:
    runner = make_runner(preset="tiny")
    free = runner.pool.allocator.num_free
    ms, gpu_ms = engine.decode_step_ms(runner, batch=2, context=24, steps=3)
    assert ms > 0 and gpu_ms is None and runner.pool.allocator.num_free == free


def test_the_planners_graphed_lengths_are_the_engines() -> None:
    """The planner keeps the prefill graphs' largest buckets as literals (it imports no engine code)."""
    from engine.prefill_graphs import BUCKETS, PARTITION_BUCKETS
    from planner.costs import PARTITION_GRAPHED_TOKENS

    assert (BUCKETS[-1], PARTITION_BUCKETS[-1]) == (GRAPHED_TOKENS, PARTITION_GRAPHED_TOKENS)
