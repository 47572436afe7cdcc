"""`bench.micro.kernel_sass` on the CPU: decode kernels compiled for sm_90a with the installed Triton and
its bundled assembler, their main loop found and counted. A 64-token attention step on 4 warps holds 32
tensor-core MMAs a warp whatever the pool (q·K^T: 64 tokens / 8 / 4 warps x 128 / 16 dims; P·V:
128 / 8 / 4 x 64 / 16); a vector-tile step one FFMA a weight a thread, which says the right loop was
found."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_the_main_loop_of_a_64_token_step_holds_its_mmas(kv: str) -> None:
    from bench.micro.kernel_sass import compile_split_kernel, loop_cost
    from engine.kernels.paged_decode import DecodeTile

    try:
        ptx, shared = compile_split_kernel(kv, DecodeTile(64, 2, 4))
        cost = loop_cost(ptx)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    assert shared >= 64 * 128 * (2 if kv == "bf16" else 1)  # at least a K tile in shared memory
    opcodes = dict(cost.opcodes)
    assert opcodes.get("HMMA") == 32
    assert cost.registers > 0 and cost.per_warp == sum(opcodes.values()) > 32
    if kv == "fp8":
        assert opcodes.get("F2FP", 0) >= 64  # e4m3 to float16, two values an instruction: 64 x 128 x 2 / 128 threads


def test_the_vector_tiles_step_holds_an_ffma_a_weight() -> None:
    from bench.micro.kernel_sass import compile_vector_kernel, loop_cost
    from engine.kernels.gemv_vector import TILES

    tile = TILES["deep"]
    try:
        cost = loop_cost(compile_vector_kernel(tile, gated=False), marker="FFMA")
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    per_thread = tile.block_n * tile.block_k // (32 * tile.num_warps)
    opcodes = dict(cost.opcodes)
    assert opcodes.get("FFMA") == per_thread and opcodes.get("F2FP") == per_thread // 2  # two e4m3 a conversion


def test_the_merge_counts_the_slices_each_trip_loads() -> None:
    """The merge that writes o_proj's e4m3 rows, at each split count of batches 3-64: a row each; where the
    compiler unrolls the slices (two and four) the one trip loads them all, 16 bytes a load."""
    from bench.micro.kernel_sass import merge_rows

    try:
        rows = merge_rows()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    per_trip = {int(str(row["splits"])): int(str(row["slices_per_trip"])) for row in rows}
    assert set(per_trip) == {2, 4, 8, 16, 32}  # paged_decode.MAX_SPLITS: at most 32
    assert per_trip[2] == 2 and per_trip[4] == 4
    assert all(1 <= slices <= splits for splits, slices in per_trip.items())


def test_an_input_bound_adds_its_clamp_and_leaves_the_weights_loop() -> None:
    """fbgemm_fp8's `activation_scale_ub` in the vector tile: x clamped (min/max instructions that were not
    there), the FFMA a weight and the conversions as they were."""
    from bench.micro.kernel_sass import compile_vector_kernel, loop_cost
    from engine.kernels.gemv_vector import TILES

    tile = TILES["deep"]
    try:
        free, bounded = (dict(loop_cost(compile_vector_kernel(tile, gated=False, x_bound=bound), marker="FFMA").opcodes)
                         for bound in (0.0, 1200.0))
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    clamps = ("HMNMX2", "FMNMX")
    assert not any(free.get(op) for op in clamps) and any(bounded.get(op) for op in clamps)
    assert bounded["FFMA"] == free["FFMA"] and bounded.get("F2FP") == free.get("F2FP")


def test_a_tile_is_read_from_the_command_line() -> None:
    import argparse

    from bench.micro.kernel_sass import parse_gemv_tile, parse_tile
    from engine.kernels.gemv import GemvConfig
    from engine.kernels.paged_decode import DecodeTile

    assert parse_gemv_tile("128:128:4:4:4") == GemvConfig(128, 128, 4, 4, 4, quantize_x=True)
    assert parse_gemv_tile("128:64:4:4:1:72").strip == 72
    with pytest.raises(argparse.ArgumentTypeError):
        parse_gemv_tile("128:64:4")

    assert parse_tile("64:5:4:128") == DecodeTile(64, 5, 4, 128)
    assert parse_tile("128:3:4") == DecodeTile(128, 3, 4, None)
    assert parse_tile("128:3:4:0") == DecodeTile(128, 3, 4, None)
    assert parse_tile("64:5:2:0:words") == DecodeTile(64, 5, 2, None, word_loads=True)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_tile("64:5")


def test_the_w8a8_tiles_step_holds_a_warpgroup_mma_per_32_deep_slice() -> None:
    """The 64-row tile's step: one FP8 warpgroup MMA (k = 32) a 32-deep slice of each strip it streams."""
    from dataclasses import replace

    from bench.micro.kernel_sass import compile_gemv_kernel, loop_cost
    from engine.kernels.gemv import FP8_WIDE_ROW_TILES

    for cfg, gated in ((FP8_WIDE_ROW_TILES["deep"], False), (replace(FP8_WIDE_ROW_TILES["wide"], block_n=64), True)):
        try:
            ptx, shared = compile_gemv_kernel(cfg, gated, bias=False)
            cost = loop_cost(ptx, marker="GMMA")
        except FileNotFoundError as missing:
            pytest.skip(str(missing))
        assert dict(cost.opcodes).get("QGMMA") == cfg.block_k // 32 * (2 if gated else 1)
        # the pipeline's stages hold the weights' and x's tiles (more with the epilogue's scratch)
        assert shared >= cfg.num_stages * (cfg.block_n * (2 if gated else 1) + 64) * cfg.block_k


def test_the_sass_hash_follows_the_machine_code() -> None:
    """Two compiles of one tile hash alike (what a tree-to-tree check relies on); another stage count, whose
    code differs, does not."""
    from bench.micro.kernel_sass import compile_split_kernel, loop_cost
    from engine.kernels.paged_decode import DecodeTile

    try:
        first, again, deeper = (loop_cost(compile_split_kernel("bf16", tile)[0]).sass_sha256
                                for tile in (DecodeTile(64, 2, 4), DecodeTile(64, 2, 4), DecodeTile(64, 3, 4)))
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    assert len(first) == 64 and first == again != deeper
