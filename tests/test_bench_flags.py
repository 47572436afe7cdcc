"""The benchmarks refuse, in one line and before touching a GPU, a flag they would take and ignore."""

from __future__ import annotations

import sys

import pytest


def test_the_attention_bench_refuses_word_loads_on_a_bf16_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Word loads are an e4m3 pool's: asked of a bf16 pool, `bench.micro.decode_attention` says so in one line
    instead of timing the byte loads under a row marked as words."""
    from bench.micro import decode_attention

    monkeypatch.setattr(sys, "argv", ["bench/micro/decode_attention.py", "--word-loads", "no", "yes"])
    with pytest.raises(SystemExit) as exit_:
        decode_attention.main()
    assert str(exit_.value.code).startswith("error: --word-loads yes:")


@pytest.mark.parametrize(("argv", "named"), [(["--quantize-x", "yes", "--sweep"], "--quantize-x: tiles of e4m3"),
                                             (["--fp8", "--wide-stages", "5"], "--wide-stages: the sweep's")])
def test_the_matmul_bench_refuses_tiles_it_would_not_time(argv: list[str], named: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench.micro.gemv` says in one line which flag would be ignored (an e4m3 tile without --fp8, a sweep's
    tile without --sweep), before it touches a GPU."""
    from bench.micro import gemv

    monkeypatch.setattr(sys, "argv", ["bench/micro/gemv.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        gemv.main()
    assert str(exit_.value.code).startswith(f"error: {named}")


@pytest.mark.parametrize(("module", "argv", "named"), [
    ("attention", ["--fp8", "--new-lengths", "1000"], "--new-lengths: first calls"),
    ("attention", ["--json", "out.json"], "--json: only --fp8's"),
    ("quantize_rows", ["--silu-warps", "4"], "--silu-warps: silu_mul_quantize_rows'"),
    ("kernel_sass", ["--kernel", "vector", "--tiles", "64:2:4"], "--tiles: attention's"),
    ("kernel_sass", ["--kernel", "attention", "--shapes", "qkv"], "--shapes: gemv's"),
])
def test_the_kernel_benches_refuse_a_mode_they_do_not_run(module: str, argv: list[str], named: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag that only another mode of the benchmark reads is refused in one line, before anything runs."""
    import importlib

    bench = importlib.import_module(f"bench.micro.{module}")
    monkeypatch.setattr(sys, "argv", [f"bench/micro/{module}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert str(exit_.value.code).startswith(f"error: {named}")
