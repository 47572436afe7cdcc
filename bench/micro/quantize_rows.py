"""`python -m bench.micro.quantize_rows`: the per-token e4m3 quantization of activations
(`engine.kernels.fp8_quant.quantize_rows`) at the Qwen2.5-7B projections' inputs, as a fraction of
HBM bandwidth; with `--silu`, the prefill's SiLU·mul and quantization of the down projection's input
(`silu_mul_quantize_rows`, from gate/up's [rows, 2 x columns] output) over its step, warp and grid
choices.

Bytes per call: x read once (16-bit) and its e4m3 rows and a float32 scale a row written. A
prefill's 4k rows of the hidden size are 44 MB, 10 us at 4.2 TB/s; a decode batch's 64 rows are
well under a microsecond of bytes, so there the launch is what is timed: each size is timed as a
chain of calls captured in a CUDA graph, the way the engine's decode steps launch them (with PDL
where the GPU has it).
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from bench.common import changed_flags, measure_hbm_gbps, replay_ms, time_cuda, write_gpu_rows
from engine.kernels import fp8_quant
from engine.kernels.fp8_quant import quantize_rows

CHAIN = 28  # calls a graph replay: one a layer, as a decode step's


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.quantize_rows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 4096, 32768])
    p.add_argument("--columns", type=int, nargs="+", default=[3584, 18944])
    p.add_argument("--silu", action="store_true", help="time silu_mul_quantize_rows instead, over the choices below")
    p.add_argument("--silu-blocks", type=int, nargs="+", default=[fp8_quant.SILU_BLOCK])
    p.add_argument("--silu-warps", type=int, nargs="+", default=[fp8_quant.SILU_WARPS])
    p.add_argument("--silu-programs-per-sm", type=int, nargs="+", default=[fp8_quant.SILU_PROGRAMS_PER_SM])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not args.silu and (flags := changed_flags(p, args, ["silu_blocks", "silu_warps", "silu_programs_per_sm"])):
        sys.exit(f"error: {flags}: silu_mul_quantize_rows' choices; add --silu")
    dev = torch.device("cuda")
    hbm = measure_hbm_gbps(dev)
    if args.silu:
        rows_out = silu_rows(args, dev, hbm)
        if args.json:
            write_gpu_rows(args.json, hbm, rows_out)
        return
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


def silu_rows(args: argparse.Namespace, dev: torch.device, hbm: float) -> list[dict[str, object]]:
    """Each (rows, columns) at each step, warp count and grid: a call's time, each call timed alone
    (prefill sizes: the launch is nothing beside the bytes). Bytes: gate and up read once, e4m3 and a
    scale written."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: list[dict[str, object]] = []
    print(f"HBM copy {hbm:,.0f} GB/s\n{'rows':>6} {'columns':>7} {'block':>5} {'warps':>5} {'a SM':>4} "
          f"{'us a call':>9} {'floor us':>8} {'of HBM':>6}")
    for rows in args.rows:
        for columns in args.columns:
            gu = torch.randn(rows, 2 * columns, dtype=torch.bfloat16, device=dev)
            floor_us = rows * (columns * 5 + 4) / (hbm * 1e9) * 1e6
            for block in args.silu_blocks:
                for warps in args.silu_warps:
                    for per_sm in args.silu_programs_per_sm:
                        us = time_cuda(functools.partial(fp8_quant.silu_mul_quantize_rows, gu, block=block,
                                                         programs=per_sm * sms, num_warps=warps)) * 1e3
                        out.append({"rows": rows, "columns": columns, "block": block, "warps": warps,
                                    "programs_per_sm": per_sm, "us": round(us, 2), "floor_us": round(floor_us, 2)})
                        print(f"{rows:>6} {columns:>7} {block:>5} {warps:>5} {per_sm:>4} {us:>9.2f} {floor_us:>8.2f} "
                              f"{floor_us / us:>6.0%}", flush=True)
            del gu
    return out


if __name__ == "__main__":
    main()
