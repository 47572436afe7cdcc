"""A KV pool of a preset's layout holding random values: what the KV transfer benchmarks move."""

from __future__ import annotations

import torch

from engine.kv_cache import KVLayout, KVPool
from engine.presets import PRESETS

CPU = torch.device("cpu")


def make_pool(preset: str, tokens: int, seed: int | None, device: torch.device = CPU,
              scattered: bool = False) -> tuple[KVPool, list[int]]:
    """A KV pool of the preset's layout holding `tokens`, and their block table; filled with random
    values from `seed` (the sending side), or left empty (`None`, the receiving side). The table
    is one run of blocks, or with `scattered` the same blocks backwards (no two neighbours adjacent,
    as in a fragmented pool: the GPU transports gather and scatter)."""
    layout = KVLayout.for_model(PRESETS[preset], torch.bfloat16, 16)
    pool = KVPool(layout, -(-tokens // 16) + 1, device)
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
        pool.storage.view(torch.int16).copy_(torch.randint(-30000, 30000, pool.storage.shape, generator=gen,
                                                           device=device, dtype=torch.int16))
    table = pool.allocator.allocate(pool.blocks_needed(tokens))
    return pool, table[::-1] if scattered else table
