"""`python -m bench.micro.kv_checksum`: what the KV checksums (`--kv-checksum on`, the default) cost a handoff,
beside the prefill they follow.

Each handoff computes engine.kv_checksum.layer_checksums twice, once per side, each over the prompt's KV
in its server's pool (the host waits for the result). Timed here on one GPU: the checksums of a real
prefill's KV in the runner's pool (its blocks one run, as in a fresh pool), and of the same length in a
pool whose blocks are scattered (gathered a layer at a time), each beside the bytes it reads over the
measured HBM bandwidth; then both sides' cost as a share of the prefill's time (the target: <= 1% at 32k).

  python -m bench.micro.kv_checksum --json bench/results/kv_checksum-h200.json                 # one H200
  python -m bench.micro.kv_checksum --preset tiny --device cpu --tokens 2048 --json /tmp/c.json  # anywhere
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.common import measure_hbm_gbps, metadata, write_json
from bench.random_pool import make_pool
from engine.kv_cache import KVPool
from engine.kv_checksum import layer_checksums

REPEATS = 10


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checksum_ms(pool: KVPool, table: list[int], tokens: int, repeats: int = REPEATS) -> float:
    """Median wall milliseconds of one side's checksums, the host's wait for them included."""
    layer_checksums(pool, table, tokens)  # warm-up
    times = []
    for _ in range(repeats):
        _sync(pool.device)
        t0 = time.perf_counter()
        layer_checksums(pool, table, tokens)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prefill_ms(preset: str, device: torch.device, tokens: int) -> tuple[float, float]:
    """(fastest of two prefills of `tokens` after a warm-up, checksum ms of its KV in the runner's pool)."""
    from engine.offline import make_runner

    on_gpu = device.type == "cuda"
    runner = make_runner(preset=preset, device=str(device), dtype=torch.bfloat16 if on_gpu else torch.float32,
                         kv_gb=8.0 if on_gpu else 0.5, max_model_len=tokens + 16)
    pool = runner.pool
    table = pool.allocator.allocate(pool.blocks_needed(tokens))
    prompt = torch.randint(0, runner.config.vocab_size, (tokens,)).tolist()
    times = []
    for i in range(3):
        _sync(device)
        t0 = time.perf_counter()
        runner.prefill(prompt, table, 0)
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    assert pool.table_start(table, tokens) is not None, "a fresh pool gives one run of blocks"
    return min(times), checksum_ms(pool, table, tokens)


def measure(preset: str, tokens: int, device: torch.device, with_prefill: bool = True) -> dict[str, Any]:
    pool, table = make_pool(preset, tokens, 1, device, scattered=True)
    kv_bytes = tokens * pool.layout.bytes_per_token
    scattered = checksum_ms(pool, table, tokens)
    del pool
    row: dict[str, Any] = {"preset": preset, "tokens": tokens, "kv_bytes": kv_bytes,
                           "scattered_ms": round(scattered, 3)}
    if with_prefill:
        prefill, in_place = prefill_ms(preset, device, tokens)
        row.update(prefill_ms=round(prefill, 2), one_run_ms=round(in_place, 3),
                   share_of_prefill_one_run=round(2 * in_place / prefill, 5),
                   share_of_prefill_scattered=round(2 * scattered / prefill, 5))
    if device.type == "cuda":
        hbm = measure_hbm_gbps(device)
        row["hbm_gbps"] = round(hbm, 1)
        for kind in ("one_run", "scattered"):
            if f"{kind}_ms" in row:  # the bytes it reads (the gather reads and writes them once more)
                moved = kv_bytes * (1 if kind == "one_run" else 3)
                row[f"{kind}_share_of_hbm"] = round(moved / (row[f"{kind}_ms"] * 1e-3) / 1e9 / hbm, 3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.kv_checksum", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-prefill", action="store_true", help="time the checksums only")
    p.add_argument("--json", help="write the rows with date, hardware, commit and command")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for tokens in args.tokens:
        row = measure(args.preset, tokens, device, not args.no_prefill)
        rows.append(row)
        share = row.get("share_of_prefill_one_run")
        print(f"{tokens:>6} tokens ({row['kv_bytes'] / 2**20:.0f} MiB of KV): checksums "
              f"{row.get('one_run_ms', '-')} ms (one run), {row['scattered_ms']} ms (scattered) a side"
              + (f"; both sides {share:.2%} of the {row['prefill_ms']:.0f} ms prefill" if share is not None else "")
              + (f"; {row['one_run_share_of_hbm']:.0%} of HBM bandwidth" if "one_run_share_of_hbm" in row else ""))
    if args.json:
        write_json(args.json, {**metadata(), "rows": rows})


if __name__ == "__main__":
    main()
