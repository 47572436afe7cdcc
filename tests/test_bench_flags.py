"""The benchmarks refuse, in one line and before touching a GPU, a flag they would take and ignore."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize(("module", "argv", "named"), [
    # word loads are an e4m3 pool's: asked of a bf16 pool, the byte loads would be timed under a row marked as words
    ("decode_attention", ["--word-loads", "no", "yes"], "--word-loads yes:"),
    ("gemv", ["--quantize-x", "yes", "--sweep"], "--quantize-x: tiles of e4m3"),
    ("gemv", ["--fp8", "--wide-stages", "5"], "--wide-stages: the sweep's"),
    ("attention", ["--fp8", "--new-lengths", "1000"], "--new-lengths: first calls"),
    ("attention", ["--json", "out.json"], "--json: only --fp8's"),
    ("quantize_rows", ["--silu-warps", "4"], "--silu-warps: silu_mul_quantize_rows'"),
    ("kernel_sass", ["--kernel", "vector", "--tiles", "64:2:4"], "--tiles: attention's"),
    ("kernel_sass", ["--kernel", "attention", "--shapes", "qkv"], "--shapes: gemv's"),
])
def test_a_kernel_bench_refuses_a_flag_it_would_ignore(module: str, argv: list[str], named: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag that only another mode of the benchmark reads (a sweep's tile without --sweep, an e4m3 tile
    without --fp8, another kernel's tiles) is refused in one line, before anything runs."""
    bench = importlib.import_module(f"bench.micro.{module}")
    monkeypatch.setattr(sys, "argv", [f"bench/micro/{module}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert str(exit_.value.code).startswith(f"error: {named}")
