"""A decode step's metadata as the CUDA graphs' staging buffer gets it: the rows written only where they
changed equal a fresh write at every step, through joins, finishes, reorders, growing tables and padding."""

from __future__ import annotations

import random

import numpy as np

from engine.decode_batch import DecodeSeq, TableRows, table_width, write_meta, write_rows

BS = 4


def test_incremental_rows_equal_a_fresh_write_at_every_step() -> None:
    rng = random.Random(0)
    host = np.full(64 * 64, -1, dtype=np.int32)  # the persistent buffer, as the graphs' pinned staging
    meta = np.zeros((4, 16), dtype=np.int32)
    writer = TableRows()
    live: list[list[int]] = []  # each sequence's table (complete from admission) and its position
    positions: dict[int, int] = {}
    next_block = 0
    for step in range(400):
        if len(live) < 12 and rng.random() < 0.3:  # a sequence joins, its whole table allocated now
            table = list(range(next_block, next_block + 40))
            next_block += 40
            live.insert(rng.randrange(len(live) + 1), table)
            positions[id(table)] = rng.randrange(0, 30)
        if live and rng.random() < 0.15:  # one finishes
            live.pop(rng.randrange(len(live)))
        if rng.random() < 0.05:
            rng.shuffle(live)
        if not live:
            continue
        seqs = []
        for table in live:
            positions[id(table)] = min(positions[id(table)] + 1, 40 * BS - 1)
            seqs.append(DecodeSeq(step, positions[id(table)], table))
        n, bucket = len(seqs), min(16, 1 << (len(seqs) - 1).bit_length())
        width = table_width(seqs, BS)
        tables = host[:bucket * width].reshape(bucket, width)
        write_meta(seqs, BS, meta)
        writer.write(seqs, BS, tables)
        tables[n:bucket, 0] = 0  # padding rows, as the graphs write them
        slots = [s.block_table[s.position // BS] * BS + s.position % BS for s in seqs]
        expected = [[s.token for s in seqs], [s.position for s in seqs], slots, [s.position + 1 for s in seqs]]
        assert meta[:, :n].tolist() == expected, step
        fresh_meta, fresh_tables = np.zeros((4, n), dtype=np.int32), np.zeros((n, width), dtype=np.int32)
        write_rows(seqs, BS, fresh_meta, fresh_tables)  # the eager path's fresh arrays
        assert fresh_meta.tolist() == expected, step
        for row, s in enumerate(seqs):
            used = s.position // BS + 1
            assert tables[row, :used].tolist() == s.block_table[:used], (step, row)
            assert fresh_tables[row, :used].tolist() == s.block_table[:used], (step, row)
