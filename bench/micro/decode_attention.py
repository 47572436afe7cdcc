"""`python -m bench.micro.decode_attention`: the paged decode attention kernel (`engine.kernels.paged_decode`)
at Qwen2.5-7B's shape (28 query heads, 4 KV heads, head dim 128, blocks of 16 tokens), per batch
size and context length, for each number of context splits, against HBM bandwidth; the split count
the engine picks (`num_splits_for`) is marked. Each figure is one CUDA-graph replay over KV layers
cycled through, divided by their count: at least `--layers`, and enough that together they hold
three times the GPU's L2, so that each layer is read from HBM as in a step (a 1k context at batch 1
is 2 MB a layer: eight of them would fit in an H200's L2, 60 MiB as the driver reports it).

With `--long-context N` the first sequence of each batch holds N tokens and the rest the context:
a step with one long history among short ones, where the layer lasts as long as the long history's
programs. Recorded as `attention-long-history-*.json`, those rows price that part of the step in
the simulator (planner.fits.fit_long_history).

`--kv-dtype fp8` reads an e4m3 pool (one byte a value, the floor halved); `--block-n`, `--stages`,
`--warps` and `--max-registers` sweep the kernel's tile (`DecodeTile`), the one the engine picks for
the dtype marked. `--pool-layout head-major` stores each layer's values head after head ([2, Hkv, slots, D],
passed to the kernel as a strided view), so that a program's reads of one KV head are contiguous rather than
one row in every Hkv; the engine's pool is token-major. Inputs are seeded by case, and each row records a
digest of its result's bits (`digest` over all rows), so two trees' kernels can be checked for the same bits
(`python -m bench.ab run ... --keys digest`)."""

from __future__ import annotations

import argparse
import hashlib
import sys
from functools import partial

import torch

from bench.common import measure_hbm_gbps, metadata, write_json
from bench.micro.gemv import graph_us
from engine.kernels.paged_decode import DecodeTile, decode_tile, num_splits_for, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.decode_attention", description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--layers", type=int, default=8, help="KV layers cycled through, at least (more if L2 holds them)")
    p.add_argument("--long-context", type=int, default=0, help="the first sequence's tokens (0: as the rest)")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--block-n", type=int, nargs="+", default=None, help="context tokens a step (default: the engine's)")
    p.add_argument("--stages", type=int, nargs="+", default=None, help="pipeline stages (default: the engine's)")
    p.add_argument("--warps", type=int, nargs="+", default=None, help="warps a program (default: the engine's)")
    p.add_argument("--max-registers", type=int, nargs="+", default=None,
                   help="registers a thread at most, 0 for the compiler's choice (default: the engine's)")
    p.add_argument("--word-loads", choices=["no", "yes"], nargs="+", default=None,
                   help="an e4m3 pool's K and V read as 32-bit words (default: the engine's)")
    p.add_argument("--pool-layout", choices=["token-major", "head-major"], nargs="+", default=["token-major"],
                   help="the pool's memory order (default: the engine's, token-major)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.kv_dtype == "bf16" and "yes" in (args.word_loads or []):
        sys.exit("error: --word-loads yes: only an e4m3 pool's K and V are read as words; add --kv-dtype fp8")
    if not torch.cuda.is_available():
        sys.exit("error: bench.micro.decode_attention times a GPU kernel; none is visible")
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    width = kv_dtype.itemsize
    dev = torch.device("cuda:0")
    hbm = measure_hbm_gbps(dev)
    l2_bytes = torch.cuda.get_device_properties(dev).L2_cache_size
    print(f"HBM copy {hbm:.0f} GB/s, L2 {l2_bytes / 2**20:.0f} MiB")
    rows = []
    for ctx in args.contexts:
        for batch in args.batches:
            torch.manual_seed(ctx * 1000 + batch)  # the same inputs in every tree
            longest = max(ctx, args.long_context)
            blocks = -(-longest // BLOCK)
            slots = batch * blocks * BLOCK + BLOCK
            count = max(args.layers, -(-3 * l2_bytes // (2 * slots * KV_HEADS * HEAD_DIM * width)))
            token_major = [torch.randn(2, slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev).to(kv_dtype)
                           for _ in range(count)]
            pools = {"token-major": token_major, "head-major": [
                kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for kv in token_major]}
            tables = (torch.arange(batch * blocks, dtype=torch.int32, device=dev) + 1).view(batch, blocks)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            lens[0] = longest
            tokens = int(lens.sum())
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
            floor_us = tokens * 2 * KV_HEADS * HEAD_DIM * width / (hbm * 1e9) * 1e6
            chosen = num_splits_for(batch, KV_HEADS)
            long = {"long_context": longest} if args.long_context else {}
            engine_tile = decode_tile(kv_dtype, batch)
            tiles = [DecodeTile(n, st, w, r or None, words == "yes") for n in args.block_n or [engine_tile.block_n]
                     for st in args.stages or [engine_tile.num_stages] for w in args.warps or [engine_tile.num_warps]
                     for r in args.max_registers or [engine_tile.max_registers]
                     for words in args.word_loads or ["yes" if engine_tile.word_loads else "no"]]
            for tile, splits, layout in [(t, s, lay) for t in tiles for s in args.splits for lay in args.pool_layout]:
                layers = pools[layout]
                us = graph_us([partial(paged_decode_attention, q, kv, tables, lens, BLOCK, None, splits, tile)
                               for kv in layers])
                out, _ = paged_decode_attention(q, layers[0], tables, lens, BLOCK, None, splits, tile)
                bits = hashlib.sha256(out.cpu().view(torch.int16).numpy().tobytes()).hexdigest()[:16]
                ours = splits == chosen and tile == engine_tile and layout == "token-major"
                shape = (f"{tile.block_n:>3}x{tile.num_stages}x{tile.num_warps}w{tile.max_registers or '':>3}r"
                         f"{' words' if tile.word_loads else ''}")
                print(f"ctx {ctx:>6} batch {batch:>3} tile {shape} splits {splits:>3} {layout:>11}: "
                      f"{us:8.1f} us  floor {floor_us:7.1f} ({floor_us / us:4.0%}){' <- engine' if ours else ''}",
                      flush=True)
                rows.append({"context": ctx, "batch": batch, **long, "splits": splits, "us": round(us, 2),
                             "floor_us": round(floor_us, 2), "engine_choice": ours, "kv_dtype": args.kv_dtype,
                             "block_n": tile.block_n, "num_stages": tile.num_stages,
                             "num_warps": tile.num_warps, "max_registers": tile.max_registers,
                             "word_loads": tile.word_loads, "pool_layout": layout, "digest": bits})
            del pools, token_major
            torch.cuda.empty_cache()
    if args.json:
        every = hashlib.sha256("".join(str(r["digest"]) for r in rows).encode()).hexdigest()[:16]
        write_json(args.json, {**metadata(), "gpu": torch.cuda.get_device_name(dev), "hbm_gbps_measured": round(hbm),
                               "digest": every, "rows": rows})


if __name__ == "__main__":
    main()
