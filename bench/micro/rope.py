"""`python -m bench.micro.rope`: the whole-prompt rope + KV-write kernel (`engine.kernels.fused.rope_and_store`)
at the Qwen2.5-7B head shape, by tokens per program, as a fraction of HBM bandwidth.

Bytes per call: qkv read once; q, k and v written head-first for attention; K and V written into
the pool; the rows of the cos and sin tables read once (their first halves). At 32k tokens that is
about 0.7 GB a layer, 0.17 ms at 4.2 TB/s; every layer of a prefill runs it once.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.common import measure_hbm_gbps, time_cuda, write_gpu_rows
from engine.attention import attention_rows
from engine.kernels.fused import rope_and_store
from engine.model.decoder import RotaryTable

HEADS, KV_HEADS, DIM = 28, 4, 128


def bytes_moved(tokens: int) -> int:
    qkv = tokens * (HEADS + 2 * KV_HEADS) * DIM * 2
    attention_inputs = tokens * (HEADS + 2 * KV_HEADS) * DIM * 2
    pool = tokens * 2 * KV_HEADS * DIM * 2
    tables = tokens * DIM * 4  # cos and sin, half a row each, float32
    return qkv + attention_inputs + pool + tables


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.rope", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    hbm = measure_hbm_gbps(dev)
    rope = RotaryTable(DIM, 1e6, max(args.tokens))
    rope.to(dev).reset()
    rows = []
    print(f"HBM copy {hbm:,.0f} GB/s\n{'tokens':>7} {'block_t':>7} {'us':>8} {'GB/s':>7} {'of HBM':>6}")
    for tokens in args.tokens:
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16, device=dev)
        pool = torch.empty(2, tokens + 16, KV_HEADS, DIM, dtype=torch.bfloat16, device=dev)
        slots = torch.randperm(tokens, device=dev)  # scattered, as a pool's blocks may be
        pos = torch.arange(tokens, device=dev)
        padded = attention_rows(tokens, dev)
        for block_t in args.block_t:
            call = partial(rope_and_store, qkv, pos, rope.cos, rope.sin, pool, slots, HEADS, KV_HEADS, DIM, padded,
                           block_t=block_t)
            us = time_cuda(call) * 1e3
            gbps = bytes_moved(tokens) / (us * 1e-6) / 1e9
            rows.append({"tokens": tokens, "block_t": block_t, "us": round(us, 1), "gbps": round(gbps, 1)})
            print(f"{tokens:>7} {block_t:>7} {us:>8.1f} {gbps:>7,.0f} {gbps / hbm:>6.0%}", flush=True)
    if args.json:
        write_gpu_rows(args.json, hbm, rows)


if __name__ == "__main__":
    main()
