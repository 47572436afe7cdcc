"""How a request's KV is named to NIXL, two ways (both pools are `[layers, 2, slots, token bytes]`, so each
layer's K or V is one plane of slots):

- prepared: at pairing, each side's whole pool as one descriptor list, every plane cut into chunks of
  `chunk` tokens (the greatest common divisor of both block sizes, so no chunk straddles a block);
  NIXL checks and prepares them once, and a request names its chunks by index.
- merged: per request, the tokens merged into runs of slots contiguous on both sides, one descriptor
  per run and plane, checked by NIXL at each transfer.

Pure numpy: nothing here loads NIXL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.kv_cache import KVPool, long_tensor


@dataclass(frozen=True)
class PoolAddress:
    """Where a pool lies for NIXL: its base address, slots, and device (-1: host memory)."""

    addr: int
    num_slots: int
    device: int

    @classmethod
    def of(cls, pool: KVPool) -> PoolAddress:
        dev = pool.device.index if pool.device.type == "cuda" and pool.device.index is not None else -1
        return cls(pool.storage.data_ptr(), pool.num_slots, dev)

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device < 0 else "VRAM"


@dataclass
class PreparedPools:
    """One pairing's two pools as prepared lists (NIXL's handles): descriptor `plane * chunks + c` of a
    side is chunk c of that plane (plane = layer * 2 + K|V)."""

    local: Any
    remote: Any
    chunk: int  # tokens a descriptor holds
    local_chunks: int  # chunks a plane, this side
    remote_chunks: int  # and the peer's
    descriptors: int  # a side's whole list (both sides': the same planes)
    released: bool = False  # set under the agent's lock; a transfer never names a released list


def chunk_tokens(local_block: int, remote_block: int) -> int:
    """The prepared lists' chunk: the largest that fits whole blocks on both sides."""
    return math.gcd(local_block, remote_block)


def plane_rows(where: PoolAddress, num_planes: int, chunk: int, token_bytes: int) -> np.ndarray:
    """A pool's whole list, compressed: one (address, bytes, device, stride, count) row per plane, whose
    `count` chunks of `chunk` tokens lie back to back."""
    if where.num_slots % chunk:
        raise ValueError(f"a pool of {where.num_slots} slots is not whole chunks of {chunk} tokens")
    plane_bytes = where.num_slots * token_bytes
    addr = where.addr + np.arange(num_planes, dtype=np.uint64) * np.uint64(plane_bytes)
    size, count = chunk * token_bytes, where.num_slots // chunk
    rows = [np.full(num_planes, v, dtype=np.uint64) for v in (size, max(where.device, 0), size, count)]
    return np.stack([addr, *rows], axis=1)


def token_slots(table: list[int] | np.ndarray, block: int, tokens: np.ndarray) -> np.ndarray:
    blocks = long_tensor(table).numpy()
    return blocks[tokens // block] * block + tokens % block


def chunk_pairs(src_table: list[int], src_block: int, dst_table: list[int], dst_block: int,
                start: int, end: int, chunk: int) -> np.ndarray:
    """Tokens [start, end) as chunk numbers within a plane, `[2, n]`: source's, then destination's. A
    last chunk that the prompt does not fill moves whole: its slots past the prompt lie in the same
    blocks of the request, which nothing reads before the prompt's KV has landed."""
    if start % chunk:
        raise ValueError(f"the transfer starts at token {start}, not at a {chunk}-token chunk's start")
    firsts = np.arange(start, end, chunk, dtype=np.int64)
    return np.stack((token_slots(src_table, src_block, firsts) // chunk,
                     token_slots(dst_table, dst_block, firsts) // chunk))


def layer_indices(pairs: np.ndarray, prepared: PreparedPools, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """One layer's descriptor indices, K's chunks then V's, in the local list and in the remote one."""
    sides = []
    for row, chunks in ((pairs[0], prepared.local_chunks), (pairs[1], prepared.remote_chunks)):
        k = row + 2 * layer * chunks
        sides.append(np.concatenate((k, k + chunks)).astype(np.int32))
    return sides[0], sides[1]


def slot_runs(src_table: list[int], src_block: int, dst_table: list[int], dst_block: int,
              start: int, end: int) -> np.ndarray:
    """Tokens [start, end) as runs contiguous on both sides: rows of (source slot, destination slot, length)."""
    t = np.arange(start, end, dtype=np.int64)
    s = token_slots(src_table, src_block, t)
    d = token_slots(dst_table, dst_block, t)
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    firsts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((firsts, [len(t)])))
    return np.stack((s[firsts], d[firsts], lengths), axis=1)


def layer_descriptors(runs: np.ndarray, base: PoolAddress, which: int, layer: int, token_bytes: int) -> np.ndarray:
    """One layer's (address, bytes, device) rows, K's runs then V's, for `runs`' column `which` (0 source, 1 dest)."""
    rows = []
    for kv in (0, 1):
        plane = (layer * 2 + kv) * base.num_slots
        addr = base.addr + (plane + runs[:, which]) * token_bytes
        rows.append(np.stack((addr, runs[:, 2] * token_bytes, np.full(len(runs), max(base.device, 0))), axis=1))
    return np.concatenate(rows).astype(np.uint64)
