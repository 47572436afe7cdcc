"""`python -m bench.micro.gemv_vector`: the e4m3 skinny matmul on CUDA cores
(`engine.kernels.gemv_vector`) against the engine's MMA tile (`engine.kernels.gemv`) and
`torch._scaled_mm`, at Qwen2.5-7B's decode shapes, as a fraction of HBM bandwidth.

Each figure is one CUDA-graph replay over one weight copy per layer (nothing served from L2, as in a
real step), divided by the layer count. gate_up is measured as the decode step runs it, with SiLU·mul
in the epilogue; the floor is one byte a weight.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch

from bench.common import measure_hbm_gbps, metadata, write_json
from bench.micro.gemv import SHAPES, graph_us, scaled_mm_linear
from engine.fp8 import FP8_MAX, quantize_per_channel
from engine.kernels.gemv import config_for, gated_config_for, gemv, gemv_silu
from engine.kernels.gemv_vector import VectorConfig, gemv_vector, supports


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.gemv_vector", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--shapes", nargs="+", default=["qkv", "o_proj", "gate_up", "down"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--block-n", type=int, nargs="+", default=[8, 16])
    p.add_argument("--block-k", type=int, nargs="+", default=[256, 512])
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--block-m", type=int, nargs="+", default=[1, 2, 4], help="rows a program (those that divide M)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = torch.device("cuda:0")
    hbm = measure_hbm_gbps(dev)
    print(f"HBM copy {hbm:.0f} GB/s (read + write)")
    tiles = [VectorConfig(*c) for c in itertools.product(args.block_n, args.block_k, args.warps, args.stages,
                                                         args.splits, args.block_m)]
    rows_out: list[dict[str, object]] = []
    for name in args.shapes:
        n, k, has_bias = SHAPES[name]
        gated = name == "gate_up"
        quantized = [quantize_per_channel(torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5)
                     for _ in range(args.layers)]
        biases = [torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None for _ in quantized]
        floor_us = n * k / (hbm * 1e9) * 1e6
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            x_scale = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
            xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
            scaled = graph_us([partial(scaled_mm_linear, xq, x_scale, w, s[None, :], b, gated)
                               for (w, s), b in zip(quantized, biases, strict=True)])
            w0, s0 = quantized[0]
            mma_cfg = gated_config_for(w0, m) if gated else config_for(w0, m)
            ref = (gemv_silu(x, w0, mma_cfg, scale=s0) if gated else gemv(x, w0, biases[0], mma_cfg, scale=s0)).float()
            mma = graph_us([partial(gemv_silu, x, w, mma_cfg, scale=s) if gated
                            else partial(gemv, x, w, b, mma_cfg, scale=s)
                            for (w, s), b in zip(quantized, biases, strict=True)])
            print(f"{name:<8} m={m:<2} floor {floor_us:6.1f} us | _scaled_mm {scaled:6.1f} | MMA tile {mma:6.1f} "
                  f"({floor_us / mma:4.0%}) {mma_cfg}", flush=True)
            best: tuple[float, VectorConfig] | None = None
            for cfg in tiles:
                if not supports(x, w0, cfg) or (gated and cfg.split_k > 1):
                    continue
                try:
                    got = gemv_vector(x, w0, s0, cfg, bias=biases[0], gated=gated).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    us = graph_us([partial(gemv_vector, x, w, s, cfg, bias=b, gated=gated)
                                   for (w, s), b in zip(quantized, biases, strict=True)])
                except Exception as e:  # a tile this GPU cannot hold
                    print(f"  {cfg}: failed ({str(e).splitlines()[0][:80]})")
                    continue
                print(f"  {cfg}: {us:6.1f} us ({floor_us / us:4.0%})  rel err vs MMA {err:.2g}", flush=True)
                rows_out.append({"shape": name, "rows": m, "config": vars(cfg), "us": round(us, 2)})
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best is not None:
                print(f"{name:<8} m={m:<2} best vector {best[0]:6.1f} us ({floor_us / best[0]:4.0%}) {best[1]} "
                      f"| MMA {mma:6.1f} | _scaled_mm {scaled:6.1f}", flush=True)
                rows_out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": round(floor_us, 2),
                                 "scaled_mm_us": round(scaled, 2), "mma_us": round(mma, 2),
                                 "vector_us": round(best[0], 2), "vector_config": vars(best[1]), "best": True})
        del quantized, biases
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, {**metadata(), "gpu": torch.cuda.get_device_name(dev), "hbm_gbps_measured": round(hbm),
                               "rows": rows_out})


if __name__ == "__main__":
    main()
