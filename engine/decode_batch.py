"""A decode step's sequences, and the per-row metadata the forward reads: each sequence's token,
position, new KV slot, context length and block table. Written once here, for the eager path's
fresh arrays and for the CUDA graphs' pinned staging buffer alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DecodeSeq:
    token: int              # the last sampled token, whose KV this step writes
    position: int           # its position in the sequence
    block_table: list[int]


def table_width(seqs: list[DecodeSeq], block_size: int) -> int:
    """Blocks in use by the longest sequence of the step: the block tables' row length."""
    return max(s.position // block_size + 1 for s in seqs)


def write_rows(seqs: list[DecodeSeq], block_size: int, meta: np.ndarray, tables: np.ndarray) -> None:
    """Row i of `meta` [4, >= n] gets sequence i's (token, position, new slot, context length), row
    i of `tables` [>= n, >= table_width] the blocks it uses; entries past those are left as they are
    (never read: the context length bounds them)."""
    for row, s in enumerate(seqs):
        used = s.position // block_size + 1
        meta[0, row], meta[1, row] = s.token, s.position
        meta[2, row], meta[3, row] = s.block_table[used - 1] * block_size + s.position % block_size, s.position + 1
        tables[row, :used] = s.block_table[:used]
