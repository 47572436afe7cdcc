"""`python -m bench.micro.gemv`: decode-time projections (Qwen2.5-7B shapes, bf16) through cuBLAS and
through the Triton skinny matmul (`engine.kernels.gemv`), as a fraction of HBM bandwidth.

Each figure is one CUDA-graph replay over one weight copy per layer (so nothing is served from
L2, as in a real step), divided by the layer count.

With `--fp8` the weights are e4m3 with a float32 scale per output row (`engine.fp8`): the skinny
matmul reads them with bf16 activations (W8A16) or, for tiles with `quantize_x` (`--quantize-x yes`),
runs FP8 tensor cores on activations quantized per row to e4m3 (W8A8), against `torch._scaled_mm`
(cuBLASLt FP8, row-wise scales); the floor is then one byte a weight. Both matmuls take the same
e4m3 rows, quantized before the timing, as the engine's norms write them for qkv and gate/up and the
attention's merge for o_proj; the 64-row tile's time with its own quantization kernel first (down's
case in the engine) is `gemv_quantizing_us`. The 16-row tile quantizes x inside, so its time includes it. Without
`--sweep`, the rows the engine runs on CUDA cores (`engine.kernels.gemv_vector`, 1-2 rows) are timed
there, so each row of the table is the kernel a decode step of that batch runs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import changed_flags, measure_hbm_gbps, metadata, replay_ms, write_json
from engine.cuda_graphs import capture
from engine.fp8 import FP8_MAX, quantize_per_channel
from engine.kernels import gemv_vector
from engine.kernels.gemv import (
    MAX_ROWS,
    WIDE_ROWS,
    E4m3Rows,
    GemvConfig,
    config_for,
    gated_config_for,
    gemv,
    gemv_silu,
    tile_rows,
)
from engine.ops import silu_mul

SHAPES = {"qkv": (4608, 3584, True), "o_proj": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False), "lm_head": (152064, 3584, False)}


def graph_us(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call, from CUDA-graph replays of all `calls` in a row, captured as the engine's graphs
    are (`engine.cuda_graphs.capture`)."""
    def run_all() -> None:
        for fn in calls:
            fn()

    graph = capture(run_all, torch.device("cuda", torch.cuda.current_device()))
    return replay_ms(graph, replays) * 1e3 / len(calls)


def _cublas_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_mul(F.linear(x, w))


def scaled_mm_linear(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     b: torch.Tensor | None, gated: bool = False) -> torch.Tensor:
    """`torch._scaled_mm` with row-wise scales on x already in e4m3, then the bias and SiLU·mul (gated)."""
    out = torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    out = out if b is None else out + b
    return silu_mul(out) if gated else out


LayerCall = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def _layers_us(call: LayerCall, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
               biases: list[torch.Tensor | None], ref: torch.Tensor) -> tuple[float, float]:
    """`call(weight, scale, bias)`'s microseconds a layer over every layer's weights in one graph, and its
    first layer's largest difference from `ref`."""
    err = (call(weights[0], scales[0], biases[0]).float() - ref.float()).abs().max().item()
    return graph_us([partial(call, w, s, b) for w, s, b in zip(weights, scales, biases, strict=True)]), err


def _vector_us(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
               biases: list[torch.Tensor | None], cfg: gemv_vector.VectorConfig, gated: bool,
               ref: torch.Tensor) -> tuple[float, float]:
    """The CUDA-core tile's microseconds a layer, and its first layer's largest difference from `ref` (W8A8:
    x's rounding to e4m3 is in the difference)."""
    def call(w: torch.Tensor, s: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        assert s is not None
        return gemv_vector.gemv_vector(x, w, s, cfg, bias=b, gated=gated)

    return _layers_us(call, weights, scales, biases, ref)


def _skinny_us(x: torch.Tensor, weights: list[torch.Tensor], scales: list[torch.Tensor | None],
               biases: list[torch.Tensor | None], cfg: GemvConfig | None, gated: bool, ref: torch.Tensor,
               x_e4m3: E4m3Rows | None) -> tuple[float, float]:
    """The MMA tile's microseconds a layer (`x_e4m3`: x's rows quantized already, else the tile's own
    quantization counted), and its first layer's largest difference from `ref`."""
    def call(w: torch.Tensor, s: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        if gated:
            return gemv_silu(x, w, cfg, scale=s, x_e4m3=x_e4m3)
        return gemv(x, w, b, cfg, scale=s, x_e4m3=x_e4m3)

    return _layers_us(call, weights, scales, biases, ref)


FP8_ONLY = ("quantize_x", "f16_mma")  # flags that set tiles of e4m3 weights
SWEEP_ONLY = (*FP8_ONLY, "wide_block_n", "wide_block_k", "wide_warps", "wide_stages", "wide_splits",
              "wide_strip_n", "wide_max_registers", "narrow_splits", "narrow_block_n", "narrow_block_k",
              "narrow_warps", "narrow_stages")


def _refused(p: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """What in `args` would be taken and ignored (a sweep's tile without --sweep, an e4m3 tile without --fp8), in
    one line; None if nothing. (--gated applies to gate_up wherever --shapes has it, and to no other shape.)"""
    if not args.fp8 and (flags := changed_flags(p, args, FP8_ONLY)):
        return f"{flags}: tiles of e4m3 weights; add --fp8"
    if not args.sweep and (flags := changed_flags(p, args, SWEEP_ONLY)):
        return f"{flags}: the sweep's tiles; add --sweep"
    return None


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.gemv", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--layers", type=int, default=28, help="weight copies cycled through (lm_head: 4)")
    p.add_argument("--sweep", action="store_true", help="try every tile configuration, not only the default")
    p.add_argument("--gated", action="store_true",
                   help="gate_up as the decode step runs it: SiLU·mul in the epilogue (`gemv_silu`), each tile's "
                        "block_n being its gate columns; cuBLAS's figure then includes the SiLU·mul kernel")
    p.add_argument("--fp8", action="store_true",
                   help="e4m3 weights with row scales, against torch._scaled_mm (row-wise scales)")
    p.add_argument("--quantize-x", nargs="+", choices=["no", "yes"], default=["no"],
                   help="with --fp8 and --sweep: tiles with bf16 activations (no), e4m3 ones (yes), or both")
    p.add_argument("--f16-mma", nargs="+", choices=["no", "yes"], default=["no"],
                   help="with --fp8 and --sweep: tiles whose products are float16 (yes), bf16 (no), or both")
    p.add_argument("--columns", type=int, nargs="+", default=None,
                   help="output columns to measure each shape at instead of its own (how the count of programs "
                        "against the 132 SMs moves the rate; gated gate_up: both halves)")
    p.add_argument("--json", default=None)
    p.add_argument("--wide-block-n", type=int, nargs="+", default=[64, 128], help="the 64-row tile's sweep")
    p.add_argument("--wide-block-k", type=int, nargs="+", default=[64, 128])
    p.add_argument("--wide-warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--wide-stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--wide-splits", type=int, nargs="+", default=[1, 2],
                   help="K splits; a count that does not divide the K steps gives shares one step apart")
    p.add_argument("--wide-strip-n", type=int, nargs="+", default=[0],
                   help="output columns a program covers, at most the tile's (0: the tile's): "
                        "a program count that fits the SMs")
    p.add_argument("--wide-max-registers", type=int, nargs="+", default=[0],
                   help="a thread's registers capped (0: uncapped), so more programs share an SM")
    p.add_argument("--narrow-splits", type=int, nargs="+", default=[1, 2, 4, 8], help="the 16-row tile's")
    p.add_argument("--narrow-block-n", type=int, nargs="+", default=[32, 64])
    p.add_argument("--narrow-block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--narrow-warps", type=int, nargs="+", default=[4])
    p.add_argument("--narrow-stages", type=int, nargs="+", default=[3, 4],
                   help="pipeline stages: one program an SM streams (stages - 1) tiles ahead")
    args = p.parse_args()
    if problem := _refused(p, args):
        sys.exit(f"error: {problem}")
    dev = torch.device("cuda:0")
    hbm = measure_hbm_gbps(dev)
    print(f"HBM copy {hbm:.0f} GB/s (read + write)")
    x_modes = [q == "yes" for q in args.quantize_x] if args.fp8 else [False]
    f16 = [f == "yes" for f in args.f16_mma] if args.fp8 else [False]
    # GemvConfig's fields in order; a tile quantizes x (W8A8) or multiplies in float16, not both: c[5], c[6];
    # a strip (c[7]) fits in its tile (c[0]); c[8] caps the registers
    narrow = [GemvConfig(*c) for c in  # the 16-row tile's candidates
              itertools.product(args.narrow_block_n, args.narrow_block_k, args.narrow_warps, args.narrow_stages,
                                args.narrow_splits, x_modes, f16) if not (c[5] and c[6])]
    wide = [GemvConfig(*c) for c in    # the 64-row tile's
            itertools.product(args.wide_block_n, args.wide_block_k, args.wide_warps, args.wide_stages,
                              args.wide_splits, x_modes, f16, args.wide_strip_n, args.wide_max_registers)
            if not (c[5] and c[6]) and c[7] <= c[0]]
    rows_out = []
    sweep_rows: list[dict[str, object]] = []  # with --sweep: every tile measured
    measured = [(shape, columns) for shape in args.shapes for columns in (args.columns or [SHAPES[shape][0]])]
    for name, n in measured:
        _, k, has_bias = SHAPES[name]
        label = name if args.columns is None else f"{name}:{n}"
        copies = 4 if name == "lm_head" else args.layers
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5 for _ in range(copies)]
        biases = [torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None for _ in range(copies)]
        scales: list[torch.Tensor | None] = [None] * copies
        if args.fp8:
            quantized = [quantize_per_channel(w) for w in weights]
            weights = [q for q, _ in quantized]
            scales = [s for _, s in quantized]
            del quantized
        floor_us = n * k * weights[0].element_size() / (hbm * 1e9) * 1e6
        for m in args.rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            gated = args.gated and name == "gate_up"
            pairs = list(zip(weights, biases, strict=True))
            if args.fp8:
                x_scale = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
                xq = (x.float() / x_scale).to(torch.float8_e4m3fn)
                ref = [scaled_mm_linear(xq, x_scale, w, s[None, :], b, gated)  # type: ignore[index]
                       for w, s, b in zip(weights, scales, biases, strict=True)]
                cublas = graph_us([partial(scaled_mm_linear, xq, x_scale, w, s[None, :], b, gated)  # type: ignore[index]
                                   for w, s, b in zip(weights, scales, biases, strict=True)])
                engine_cfg = gated_config_for(weights[0], m) if gated else config_for(weights[0], m)
            elif gated:
                ref = [silu_mul(F.linear(x, w)) for w in weights]
                cublas = graph_us([partial(_cublas_silu, x, w) for w in weights])
                engine_cfg = gated_config_for(weights[0], m)
            else:
                ref = [F.linear(x, w, b) for w, b in pairs]
                cublas = graph_us([partial(F.linear, x, w, b) for w, b in pairs])
                engine_cfg = config_for(weights[0], m)
            configs: list[GemvConfig | None] = [None]  # the engine's choice for the shape
            if args.sweep:  # the engine's own tile first, so its figure is always beside the others
                tiles = narrow if tile_rows(weights[0], m) == MAX_ROWS else wide
                configs = [engine_cfg] * (engine_cfg is not None) + [c for c in tiles if c != engine_cfg]
            elif engine_cfg is None:
                configs = []
            vector = gemv_vector.config_for(x, weights[0], gated) if args.fp8 and not args.sweep else None
            if vector is not None:  # the engine's route at these rows: the CUDA-core tile
                us, err = _vector_us(x, weights, scales, biases, vector, gated, ref[0])
                print(f"{label:<8} m={m:<3} floor {floor_us:7.1f} us | cuBLAS {cublas:7.1f} us "
                      f"({floor_us / cublas:4.0%}) | vector {us:7.1f} us ({floor_us / us:4.0%}) {vector}  "
                      f"max err {err:.3g}", flush=True)
                rows_out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": round(floor_us, 2),
                                 "cublas_us": round(cublas, 2), "gemv_us": round(us, 2), "gemv_config": vars(vector),
                                 "route": "vector", "gated": gated})
                continue
            if m > WIDE_ROWS or not configs:  # the engine sends these rows through cuBLAS only
                print(f"{label:<8} m={m:<3} floor {floor_us:7.1f} us | cuBLAS {cublas:7.1f} us "
                      f"({floor_us / cublas:4.0%})", flush=True)
                rows_out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": round(floor_us, 2),
                                 "cublas_us": round(cublas, 2), "gemv_us": None, "gemv_config": None})
                continue
            best: tuple[float, GemvConfig | None] | None = None
            wide_w8a8 = args.fp8 and tile_rows(weights[0], m) == WIDE_ROWS  # such tiles take x's e4m3 rows
            e4m3_rows = (xq, x_scale) if args.fp8 else None
            for cfg in configs:
                if cfg is not None and not cfg.fits(k):
                    continue
                if gated and cfg is not None and cfg.split_k > 1:
                    continue  # the gated tile is unsplit
                try:
                    tile = cfg or engine_cfg
                    rows = e4m3_rows if wide_w8a8 and tile is not None and tile.quantize_x else None
                    us, err = _skinny_us(x, weights, scales, biases, cfg, gated, ref[0], rows)
                except Exception as e:  # a tile that does not fit this GPU's shared memory
                    print(f"  {name} m={m} {cfg}: failed ({str(e).splitlines()[0][:80]})")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
                if args.sweep:
                    tile = cfg or engine_cfg
                    sweep_rows.append({"shape": name, "rows": m, "config": vars(tile), "us": round(us, 2),
                                       "engine_choice": tile == engine_cfg})
                    mark = " <- engine" if tile == engine_cfg else ""
                    print(f"  {name} m={m} {tile}: {us:7.1f} us  max err {err:.3g}{mark}")
            assert best is not None
            chosen = best[1] or engine_cfg
            assert chosen is not None
            quantizing = (_skinny_us(x, weights, scales, biases, chosen, gated, ref[0], None)[0]
                          if wide_w8a8 and chosen.quantize_x else None)
            print(f"{label:<8} m={m:<3} floor {floor_us:7.1f} us | cuBLAS {cublas:7.1f} us ({floor_us / cublas:4.0%}) "
                  f"| gemv {best[0]:7.1f} us ({floor_us / best[0]:4.0%}) {chosen}"
                  + ("" if quantizing is None else f" | {quantizing:.1f} us with its quantization"), flush=True)
            rows_out.append({"shape": name, "n": n, "k": k, "rows": m, "floor_us": round(floor_us, 2),
                             "cublas_us": round(cublas, 2), "gemv_us": round(best[0], 2), "gemv_config": vars(chosen),
                             "route": "skinny", "gated": gated,
                             "gemv_quantizing_us": None if quantizing is None else round(quantizing, 2)})
        del weights, biases, scales
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, {**metadata(), "gpu": torch.cuda.get_device_name(dev), "hbm_gbps_measured": round(hbm),
                               "fp8": args.fp8, "rows": rows_out, **({"sweep": sweep_rows} if args.sweep else {})})


if __name__ == "__main__":
    main()
