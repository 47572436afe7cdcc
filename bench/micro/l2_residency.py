"""`python -m bench.micro.l2_residency`: would the decode step's small projections run faster if their
weights were read into L2 while the kernel before them runs?

At batch 1, qkv and o_proj take 11.6 and 9.6 µs against 7.8 and 6.1 at the copy bandwidth: their
ramp and tail. If the weights were already in L2 (60 MiB on an H200, a 26-33 MB weight fits),
another kernel could read them there during the attention. This times, one row through the
engine's skinny matmul, each projection:
- cold: one weight copy per layer in turn (as in a step);
- hot: the same copy every time (the best an L2-resident weight can do);
- after a read kernel that loads the weight with `evict_last` (on P programs), and that kernel
  alone: what the read costs and whether it leaves the weight in L2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

from bench.common import metadata, write_json
from bench.micro.gemv import SHAPES, graph_us
from engine.kernels.gemv import gemv


@triton.jit
def _read_kernel(W, N, OUT, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Loads W[:N] (int32 words) into L2, program-strided; the xor of the words is stored so that
    the loads are kept."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        idx = (i * tl.num_programs(0) + pid) * BLOCK + offs
        acc ^= tl.load(W + idx, mask=idx < N, other=0, eviction_policy="evict_last")
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


def read_into_l2(weight: torch.Tensor, sink: torch.Tensor, programs: int, block: int = 4096) -> None:
    words = weight.view(-1).view(torch.int32)
    iters = triton.cdiv(words.numel(), programs * block)
    _read_kernel[(programs,)](words, words.numel(), sink, BLOCK=block, ITERS=iters, num_warps=4)


def _shape_row(name: str, layers: int, program_counts: list[int], sink: torch.Tensor,
               dev: torch.device) -> dict[str, Any]:
    n, k, _ = SHAPES[name]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(layers)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)

    def per_layer(calls: Sequence[Callable[[], object]]) -> float:  # µs a layer, from one graph of all the calls
        return graph_us(calls) * len(calls) / layers

    row: dict[str, Any] = {"shape": name, "mb": round(n * k * 2 / 1e6, 1),
                           "cold_us": round(per_layer([partial(gemv, x, w) for w in weights]), 2),
                           "hot_us": round(per_layer([partial(gemv, x, weights[0]) for _ in weights]), 2),
                           "after_read": []}
    print(f"{name}: cold {row['cold_us']} us, hot (one copy, from L2) {row['hot_us']} us", flush=True)
    for programs in program_counts:
        reads = [partial(read_into_l2, w, sink, programs) for w in weights]
        alone = per_layer(reads)
        both = per_layer([call for read, w in zip(reads, weights, strict=True) for call in (read, partial(gemv, x, w))])
        print(f"  read on {programs} programs {alone:.1f} us, then the matmul {both - alone:.1f} us", flush=True)
        row["after_read"].append({"programs": programs, "read_us": round(alone, 2), "gemv_us": round(both - alone, 2)})
    return row


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.l2_residency", description=__doc__)
    p.add_argument("--shapes", nargs="+", default=["qkv", "o_proj"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--programs", type=int, nargs="+", default=[32, 66, 132])
    p.add_argument("--json", default="bench/results/l2-residency-h200.json")
    args = p.parse_args()
    dev = torch.device("cuda:0")
    sink = torch.zeros(max(args.programs), dtype=torch.int32, device=dev)
    rows = [_shape_row(name, args.layers, args.programs, sink, dev) for name in args.shapes]
    write_json(args.json, {**metadata(), "rows": rows})


if __name__ == "__main__":
    main()
