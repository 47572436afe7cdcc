"""`python -m bench.micro.quantize_rows`: the per-token e4m3 quantization of activations
(`engine.kernels.fp8_quant.quantize_rows`) at the Qwen2.5-7B projections' inputs, as a fraction of
HBM bandwidth.

Bytes per call: x read once (16-bit) and its e4m3 rows and a float32 scale a row written. A
prefill's 4k rows of the hidden size are 44 MB, 10 us at 4.2 TB/s; a decode batch's 64 rows are
well under a microsecond of bytes, so there the launch is what is timed: each size is timed as a
chain of calls captured in a CUDA graph, the way the engine's decode steps launch them (with PDL
where the GPU has it).
"""

from __future__ import annotations

import argparse

import torch

from bench.common import measure_hbm_gbps, replay_ms, write_gpu_rows
from engine.kernels.fp8_quant import quantize_rows

CHAIN = 28  # calls a graph replay: one a layer, as a decode step's


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.quantize_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 4096, 32768])
    p.add_argument("--columns", type=int, nargs="+", default=[3584, 18944])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    hbm = measure_hbm_gbps(dev)
    rows_out = []
    print(f"HBM copy {hbm:,.0f} GB/s\n{'rows':>6} {'columns':>7} {'us a call':>9} {'floor us':>8} {'of HBM':>6}")
    for rows in args.rows:
        for columns in args.columns:
            x = torch.randn(rows, columns, dtype=torch.bfloat16, device=dev)
            quantize_rows(x)  # compiled before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(CHAIN):
                    quantize_rows(x)
            us = replay_ms(graph) * 1e3 / CHAIN
            floor_us = rows * (columns * 3 + 4) / (hbm * 1e9) * 1e6
            rows_out.append({"rows": rows, "columns": columns, "us": round(us, 2), "floor_us": round(floor_us, 2)})
            print(f"{rows:>6} {columns:>7} {us:>9.2f} {floor_us:>8.2f} {floor_us / us:>6.0%}", flush=True)
            del graph, x
    if args.json:
        write_gpu_rows(args.json, hbm, rows_out)


if __name__ == "__main__":
    main()
