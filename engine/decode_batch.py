"""A decode step's sequences, and the per-row metadata the forward reads: each sequence's token,
position, new KV slot, context length and block table. Written once here, for the eager path's
fresh arrays and for the CUDA graphs' pinned staging buffer alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)  # not frozen: a step makes one a row, and a frozen one takes 4x as long to make
class DecodeSeq:
    token: int              # the last sampled token, whose KV this step writes
    position: int           # its position in the sequence
    block_table: list[int]
    source_row: int = -1    # >= 0: the token is that row of the previous step's tokens, still on the
    #                         device (the step was launched before they were read back); `token` unused


def sources(seqs: list[DecodeSeq]) -> np.ndarray | None:
    """Each row's `source_row`, or None when every token is given."""
    rows = np.fromiter((s.source_row for s in seqs), dtype=np.int64, count=len(seqs))
    return rows if (rows >= 0).any() else None


def table_width(seqs: list[DecodeSeq], block_size: int) -> int:
    """Blocks in use by the longest sequence of the step: the block tables' row length."""
    return max(s.position // block_size + 1 for s in seqs)


def write_meta(seqs: list[DecodeSeq], block_size: int, meta: np.ndarray) -> None:
    """Columns 0..n-1 of `meta` [4, >= n]: each sequence's token, position, new slot and context length."""
    n = len(seqs)
    positions = np.fromiter((s.position for s in seqs), dtype=np.int64, count=n)
    last_blocks = np.fromiter((s.block_table[s.position // block_size] for s in seqs), dtype=np.int64, count=n)
    meta[0, :n] = np.fromiter((s.token for s in seqs), dtype=np.int64, count=n)
    meta[1, :n] = positions
    meta[2, :n] = last_blocks * block_size + positions % block_size
    meta[3, :n] = positions + 1


class TableRows:
    """Writes a step's block tables into a buffer that persists from step to step (the CUDA graphs'
    pinned staging), rewriting only what changed. A sequence's table is complete from admission and
    only its used length grows, so a row that holds the same table (the same list object, kept here
    so its identity cannot be reused) at the same row length needs only its newly used entries (a
    full rewrite costs host time a step while the GPU idles: bench/NOTES.md)."""

    def __init__(self) -> None:
        self._rows: list[tuple[list[int], int]] = []  # row -> (its table, entries written)
        self._width = -1

    def write(self, seqs: list[DecodeSeq], block_size: int, tables: np.ndarray) -> None:
        """Rows 0..n-1 of `tables` [>= n, width]; the caller may overwrite rows from n on (padding)."""
        width = tables.shape[1]
        kept = self._rows if width == self._width else []
        rows: list[tuple[list[int], int]] = []
        for row, s in enumerate(seqs):
            used = s.position // block_size + 1
            start = kept[row][1] if row < len(kept) and kept[row][0] is s.block_table and kept[row][1] <= used else 0
            if start < used:
                tables[row, start:used] = s.block_table[start:used]
            rows.append((s.block_table, used))
        self._rows, self._width = rows, width


def write_rows(seqs: list[DecodeSeq], block_size: int, meta: np.ndarray, tables: np.ndarray) -> None:
    """Row i of `meta` [4, >= n] gets sequence i's (token, position, new slot, context length), row
    i of `tables` [>= n, >= table_width] the blocks it uses; entries past those are left as they are
    (never read: the context length bounds them)."""
    write_meta(seqs, block_size, meta)
    for row, s in enumerate(seqs):
        used = s.position // block_size + 1
        tables[row, :used] = s.block_table[:used]
