"""engine.kv_checksum: the same KV gives the same per-layer checksums in any pool (block size, block
placement), and each kind of damage a handoff can do changes the damaged layer's checksum only."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVLayout, KVPool
from engine.kv_checksum import (
    LayerChecksums,
    first_mismatch,
    layer_checksums,
    layer_checksums_of,
    layer_checksums_on_own_stream,
)

LAYOUT = KVLayout("m", "bfloat16", 3, 2, 8, 4)
TOKENS = 21


def kv(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=gen).to(
        LAYOUT.torch_dtype)


def pool_with(data: torch.Tensor, block_size: int, scattered: bool) -> tuple[KVPool, list[int]]:
    layout = KVLayout(LAYOUT.model, LAYOUT.dtype, LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, block_size)
    pool = KVPool(layout, 64, torch.device("cpu"), reserved_blocks=1)
    table = pool.allocator.allocate(pool.blocks_needed(TOKENS))
    table = table[::-1] if scattered else table
    for layer in range(layout.num_layers):
        pool.write(layer, pool.slots(table, 0, TOKENS), data[layer])
    return pool, table


@pytest.mark.parametrize("block_size,scattered", [(4, False), (4, True), (16, True), (1, True)])
def test_same_kv_same_checksums_in_any_pool(block_size: int, scattered: bool) -> None:
    data = kv()
    expected = [s % (1 << 64) for s in layer_checksums_of(data).tolist()]
    pool, table = pool_with(data, block_size, scattered)
    assert layer_checksums(pool, table, TOKENS) == expected
    assert len(set(expected)) == LAYOUT.num_layers


def damaged(kind: str) -> torch.Tensor:
    data = kv()
    if kind == "one bit":
        data[1].view(torch.int16)[0, 5, 1, 3] ^= 1
    elif kind == "two tokens swapped":
        data[1, :, [3, 9]] = data[1, :, [9, 3]]
    elif kind == "K and V swapped":
        data[1] = data[1].flip(0)
    elif kind == "a block of another request":
        data[1, :, 4:8] = kv(seed=1)[1, :, 4:8]
    elif kind == "a block left as zeros":
        data[1, :, 8:12] = 0
    return data


@pytest.mark.parametrize("kind", ["one bit", "two tokens swapped", "K and V swapped", "a block of another request",
                                  "a block left as zeros"])
def test_damage_changes_the_damaged_layers_checksum(kind: str) -> None:
    good = layer_checksums_of(kv()).tolist()
    bad = layer_checksums_of(damaged(kind)).tolist()
    assert first_mismatch(good, bad) == 1 and good[0] == bad[0] and good[2] == bad[2]


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2


def test_checksum_benchmark_runs_on_the_cpu() -> None:
    """bench.micro.kv_checksum end to end with the tiny preset: both layouts timed beside a real prefill."""
    from bench.micro.kv_checksum import measure

    row = measure("tiny", 256, torch.device("cpu"))
    assert row["prefill_ms"] > 0 and row["one_run_ms"] > 0 and row["scattered_ms"] > 0
    # The share comes from the unrounded times and is itself rounded to 1e-5; the row's times are rounded
    # to 0.001 and 0.01 ms: the bound is the sum of the two roundings (pytest.approx takes the larger alone).
    expected = 2 * row["one_run_ms"] / row["prefill_ms"]
    times_rounding = expected * (0.0005 / row["one_run_ms"] + 0.005 / row["prefill_ms"])
    assert abs(row["share_of_prefill_one_run"] - expected) <= 1.01 * (times_rounding + 0.5e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scattered", [False, True])
def test_the_gpu_gives_the_cpus_checksums(scattered: bool) -> None:
    """Each side computes on its own device: a GPU's wrapping integer sums must equal the CPU's."""
    data = kv()
    cpu_pool, cpu_table = pool_with(data, 4, scattered)
    gpu_pool = KVPool(cpu_pool.layout, 64, torch.device("cuda"), reserved_blocks=1)
    gpu_pool.storage.copy_(cpu_pool.storage)
    assert layer_checksums(gpu_pool, cpu_table, TOKENS) == layer_checksums(cpu_pool, cpu_table, TOKENS)
    # the decode side's check, on its own stream, while the engine's stream is busy
    torch.cuda._sleep(50_000_000)
    assert layer_checksums_on_own_stream(gpu_pool, cpu_table, TOKENS) == layer_checksums(cpu_pool, cpu_table, TOKENS)
    # the prefill side's, layer by layer behind the engine's stream
    checks = LayerChecksums(gpu_pool, gpu_pool.slots(cpu_table, 0, TOKENS), gpu_pool.table_start(cpu_table, TOKENS))
    for layer in range(LAYOUT.num_layers):
        torch.cuda._sleep(1_000_000)
        checks.layer_done(layer)
    assert checks.result() == layer_checksums(cpu_pool, cpu_table, TOKENS)


@pytest.mark.parametrize("block_size,scattered,start", [(4, False, 0), (4, True, 0), (4, False, 5), (1, True, 3)])
def test_layer_by_layer_checksums_equal_the_whole_prompts(block_size: int, scattered: bool, start: int) -> None:
    """The prefill side takes each layer's checksum as that layer is done; together they are the
    prompt's checksums, skipped tokens (the decode side's cached prefix) included."""
    data = kv()
    pool, table = pool_with(data, block_size, scattered)
    slots, first = pool.slots(table, start, TOKENS), pool.table_start(table, TOKENS, start)
    checks = LayerChecksums(pool, slots, first)
    for layer in range(LAYOUT.num_layers):
        checks.layer_done(layer)
    assert checks.result() == layer_checksums(pool, table, TOKENS, start)
    partial = LayerChecksums(pool, slots, first)
    partial.layer_done(0)
    with pytest.raises(RuntimeError, match="checksums of 1 layers"):
        partial.result()
