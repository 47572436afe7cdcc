"""How a request's KV is named to NIXL (engine.transport.nixl_descriptors), and bench.micro.nixl_descriptors
on the tiny preset: both ways move the same bytes, and NIXL merges the prepared lists' neighbouring
chunks into as few descriptors as the merged runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.transport.nixl import nixl_available
from engine.transport.nixl_descriptors import (
    PoolAddress,
    PreparedPools,
    chunk_pairs,
    chunk_tokens,
    layer_indices,
    plane_rows,
)

ROOT = Path(__file__).resolve().parent.parent


def test_chunks_name_each_tokens_slot_on_both_sides() -> None:
    src, dst = [7, 2, 9], [3, 0]  # 16-token blocks here, 32 there: 16-token chunks
    chunk = chunk_tokens(16, 32)
    pairs = chunk_pairs(src, 16, dst, 32, 16, 40, chunk)  # the first 16 tokens cached on the decode side
    assert chunk == 16 and pairs.tolist() == [[2, 9], [7, 0]]  # tokens 16-31: src block 2, dst block 3's second half
    prepared = PreparedPools(None, None, chunk, local_chunks=10, remote_chunks=4, descriptors=0)
    local, remote = layer_indices(pairs, prepared, layer=1)
    assert local.tolist() == [22, 29, 32, 39] and remote.tolist() == [15, 8, 19, 12]  # K's, then V's
    assert local.dtype == np.int32
    with pytest.raises(ValueError, match="not at a 16-token chunk"):
        chunk_pairs(src, 16, dst, 32, 8, 40, chunk)


def test_plane_rows_cover_the_pool_in_chunks() -> None:
    rows = plane_rows(PoolAddress(1000, 64, -1), num_planes=4, chunk=16, token_bytes=8)
    assert rows.tolist() == [[1000 + p * 64 * 8, 128, 0, 128, 4] for p in range(4)]
    with pytest.raises(ValueError, match="not whole chunks"):
        plane_rows(PoolAddress(1000, 60, -1), 4, 16, 8)


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_benchmark_moves_every_byte_both_ways(tmp_path: Path) -> None:
    """Run as the command it is: NIXL is never loaded into the test process (see nixl_available)."""
    out = tmp_path / "d.json"
    done = subprocess.run([sys.executable, "-m", "bench.micro.nixl_descriptors", "--preset", "tiny", "--tokens", "256",
                           "1000", "--repeats", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["tokens"], r["blocks"], r["method"]): r for r in doc["rows"]}
    assert len(rows) == 8 and all(r["bitwise_equal"] and r["make_ms"] > 0 for r in rows.values()), rows
    for (tokens, blocks, _), r in rows.items():
        assert r["descriptors_posted_a_layer"] == (2 if blocks == "one run" else 2 * -(-tokens // 16)), r
    planes = 2 * rows[256, "one run", "prepared"]["layers"]
    assert doc["prepared_descriptors_a_side"] == planes * doc["pool_slots"] // 16
