"""`python -m bench.micro.gemv_ws`: the 64-row W8A8 projection (x's rows in e4m3 with a scale a row, e4m3
weights with a scale an output row) as a bulk-copy (TMA) tile whose K loop Triton may warp-specialize: a
producer warp issues the copies into a ring of `stages` buffers and consumer warpgroups run the MMAs, so the
copies in flight no longer wait on the MMAs' warps. Against the engine's pointer tile on the same rows
(`engine.kernels.gemv`, its tile for the shape), both over one weight copy a layer in one CUDA graph, as
`bench.micro.gemv` times them.

The 64-row tiles are latency-bound (Nsight Compute: down at 58% of DRAM's peak and 66% of L2's, 24% of the
SMs'), and a software-pipelined loop keeps its copies and its MMAs in the same warps. Each row prints the
largest difference from the engine tile's output (the K sums in another order: a few bf16 units at most).
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.common import measure_hbm_gbps, metadata, write_json
from bench.micro.gemv import SHAPES, graph_us
from engine.fp8 import FP8_MAX, quantize_per_channel
from engine.kernels.gemv import WIDE_ROWS, config_for, gemv


@triton.jit
def _w8a8_copy_kernel(x_desc, w_desc, X_SCALE, W_SCALE, OUT, M, N, K, s_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    off_n = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WARP_SPECIALIZE):
        x = x_desc.load([0, k])
        w = w_desc.load([off_n, k])
        acc = tl.dot(x, w.T, acc)
    rows = tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    x_scale = tl.load(X_SCALE + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(W_SCALE + cols, mask=cols < N, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    tl.store(OUT + rows[:, None] * s_om + cols[None, :], out.to(tl.bfloat16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def copy_tile(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
              block_k: int, stages: int, warp_specialize: bool) -> torch.Tensor:
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [WIDE_ROWS, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    compiled = _w8a8_copy_kernel[(triton.cdiv(n, block_n),)](
        x_desc, w_desc, x_scale, w_scale, out, m, n, k, out.stride(0), BLOCK_M=WIDE_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, WARP_SPECIALIZE=warp_specialize, num_warps=4)
    if compiled is not None:  # None under Triton's interpreter
        COMPILED[(block_n, block_k, stages, warp_specialize)] = (compiled.metadata.num_warps,
                                                                 compiled.metadata.shared)
    return out


COMPILED: dict[tuple[int, int, int, bool], tuple[int, int]] = {}  # a tile's warps and shared memory, as compiled


def _shape_rows(name: str, args: argparse.Namespace, hbm: float, dev: torch.device) -> list[dict[str, object]]:
    """The engine tile's row and each copy tile's for one projection."""
    n, k, _ = SHAPES[name]
    layers = [quantize_per_channel(torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5)
              for _ in range(args.layers)]
    x = torch.randn(args.rows, k, dtype=torch.bfloat16, device=dev)
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).contiguous()
    xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
    floor_us = n * k / (hbm * 1e9) * 1e6
    cfg = config_for(layers[0][0], args.rows)
    assert cfg is not None and cfg.quantize_x, f"{name}: no W8A8 tile at {args.rows} rows"
    ref = gemv(x, *layers[0][:1], None, cfg, scale=layers[0][1], x_e4m3=(xq, x_scale)).float()
    us = graph_us([partial(gemv, x, w, None, cfg, scale=s, x_e4m3=(xq, x_scale)) for w, s in layers])
    rows: list[dict[str, object]] = [{"shape": name, "tile": f"engine {cfg}", "us": round(us, 2),
                                      "floor_us": round(floor_us, 2), "max_diff": 0.0}]
    print(f"{name:7s} engine tile {us:7.2f} us (floor {floor_us:.2f})")
    for bn, bk, stages, ws in itertools.product(args.block_n, args.block_k, args.stages, args.warp_specialize):
        spec, label = ws == "yes", f"{bn}x{bk}x{stages} ws={ws}"
        try:
            diff = (copy_tile(xq, x_scale, *layers[0], bn, bk, stages, spec).float() - ref).abs().max().item()
            us = graph_us([partial(copy_tile, xq, x_scale, w, s, bn, bk, stages, spec) for w, s in layers])
        except Exception as e:  # a tile that does not compile or fit: said, and the sweep goes on
            print(f"{name:7s} {label}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        warps, shared = COMPILED.get((bn, bk, stages, spec), (0, 0))
        rows.append({"shape": name, "tile": label, "us": round(us, 2), "floor_us": round(floor_us, 2),
                     "max_diff": diff, "warps": warps, "shared_bytes": shared})
        print(f"{name:7s} {label:22s} {us:7.2f} us  diff {diff:.4f}  {warps} warps, {shared // 1024} KB")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.gemv_ws", description=__doc__)
    p.add_argument("--shapes", nargs="+", default=["down", "o_proj", "qkv"], choices=["down", "o_proj", "qkv"])
    p.add_argument("--rows", type=int, default=WIDE_ROWS)
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    p.add_argument("--warp-specialize", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda:0")
    hbm = measure_hbm_gbps(dev)
    print(f"HBM copy {hbm:.0f} GB/s (read + write)")
    rows = [row for name in args.shapes for row in _shape_rows(name, args, hbm, dev)]
    if args.json:
        write_json(args.json, {**metadata(), "hbm_gbps_measured": round(hbm, 1), "rows_of_x": args.rows,
                               "rows": rows})


if __name__ == "__main__":
    main()
