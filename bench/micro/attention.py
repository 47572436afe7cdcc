"""`python -m bench.micro.attention`: one layer's causal prefill attention at Qwen2.5-7B's shape through
each SDPA route, against the bf16 matrix rate, to choose the prefill path.

--new-lengths: what a prompt length never seen before costs each layout (cuDNN builds an execution
plan per shape unless TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 sends it down its ragged path), and the
steady rate of each at the longest length.

--fp8: cuDNN's FP8 attention (`engine.attention_fp8`, what a server with an e4m3 KV pool runs) against
the bf16 route the engine takes otherwise, on the same q, k, v: time with and without taking q, k, v
to e4m3, the rate against the bf16 matrix rate, the output's error against the bf16 route's, and
with --json each length's figures."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import changed_flags, measure_bf16_tflops, metadata, time_cuda, write_json


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.attention", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--new-lengths", type=int, nargs="+", default=None,
                   help="time the first call at each of these lengths (then --tokens' last, steady)")
    p.add_argument("--fp8", action="store_true", help="cuDNN's FP8 attention against the bf16 route")
    p.add_argument("--json", default=None, help="with --fp8: write the figures here")
    args = p.parse_args()
    if args.fp8 and (flags := changed_flags(p, args, ["new_lengths"])):
        sys.exit(f"error: {flags}: first calls are timed on the bf16 route; leave it out with --fp8")
    if not args.fp8 and args.json:
        sys.exit("error: --json: only --fp8's figures are written; add --fp8, or leave --json out")
    dev = torch.device("cuda:0")
    peak = measure_bf16_tflops(dev)
    if args.fp8:
        rows = [measure_fp8(n, peak, dev) for n in args.tokens]
        if args.json:
            write_json(args.json, {**metadata(), "gpu": torch.cuda.get_device_name(dev),
                                   "bf16_tflops_measured": round(peak), "rows": rows})
        return
    if args.new_lengths:
        first_calls(args.new_lengths, args.tokens[-1], peak, dev)
        return
    for n in args.tokens:
        measure(n, peak, dev)


def _layouts(n: int, dev: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """The same attention laid out as the prefill could write it: (q, k, v, enable_gqa), [1, H, T, D] views."""
    heads, kv_heads, dim = 28, 4, 128
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(n, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    kx, vx = (t.repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    return {
        "heads-first, expanded": (q.transpose(0, 1).contiguous()[None], kx.transpose(0, 1).contiguous()[None],
                                  vx.transpose(0, 1).contiguous()[None], False),
        "token-major, expanded": (q.transpose(0, 1)[None], kx.transpose(0, 1)[None], vx.transpose(0, 1)[None],
                                  False),
        "token-major, gqa": (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], True),
    }


def first_calls(lengths: list[int], steady: int, peak: float, dev: torch.device) -> None:
    print(f"TORCH_CUDNN_SDPA_AVOID_RECOMPILE={os.environ.get('TORCH_CUDNN_SDPA_AVOID_RECOMPILE', '0')}")
    for name in _layouts(16, dev):
        cells = []
        for n in lengths:
            q, k, v, gqa = _layouts(n, dev)[name]
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
                    torch.cuda.synchronize(dev)
                    cells.append(f"{n}: {(time.perf_counter() - t0) * 1e3:.1f}")
            except RuntimeError as e:
                cells.append(f"{n}: unavailable ({str(e).splitlines()[0][:40]})")
        q, k, v, gqa = _layouts(steady, dev)[name]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = time_cuda(lambda q=q, k=k, v=v, gqa=gqa: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa), iters=5, warmup=2)
        flops = 2 * steady * steady * 28 * 128
        print(f"{name:<24} first call ms {', '.join(cells)} | steady at {steady}: {ms:.2f} ms "
              f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / peak:.0%})", flush=True)


def measure(n: int, peak: float, dev: torch.device) -> None:
    heads, kv_heads, dim = 28, 4, 128
    q = torch.randn(n, heads, dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(n, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    flops = 2 * n * n * heads * dim  # QK^T and PV over the causal half
    qt = q.transpose(0, 1).unsqueeze(0)
    kx = k.transpose(0, 1).repeat_interleave(heads // kv_heads, 0).unsqueeze(0)
    vx = v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0).unsqueeze(0)
    kg, vg = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    variants = {
        "expanded kv, strided q": lambda: F.scaled_dot_product_attention(qt, kx, vx, is_causal=True),
        "expanded kv, contiguous q": lambda: F.scaled_dot_product_attention(qt.contiguous(), kx, vx,
                                                                             is_causal=True),
        "enable_gqa": lambda: F.scaled_dot_product_attention(qt.contiguous(), kg.contiguous(), vg.contiguous(),
                                                             is_causal=True, enable_gqa=True),
        "expand inside (incl. copies)": lambda: F.scaled_dot_product_attention(
            qt, k.transpose(0, 1).repeat_interleave(7, 0).unsqueeze(0),
            v.transpose(0, 1).repeat_interleave(7, 0).unsqueeze(0), is_causal=True),
    }
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for name, fn in variants.items():
            try:
                with sdpa_kernel([backend]):
                    ms = time_cuda(fn, iters=5, warmup=2)
                print(f"{n:>6} {backend.name:<20} {name:<30} {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s "
                      f"({flops / ms / 1e9 / peak:.0%} of {peak:.0f})", flush=True)
            except RuntimeError as e:
                print(f"{n:>6} {backend.name:<20} {name:<30} unavailable: {str(e).splitlines()[0][:60]}")


def measure_fp8(n: int, peak: float, dev: torch.device) -> dict[str, float]:
    """One layer at Qwen2.5-7B's shape (q, k, v of unit variance): the bf16 route, FP8 attention with its
    conversions, those of q, k and v alone (the kernel's rate counts the rest, O's way back included), and
    the FP8 output's error against the bf16 route's."""
    from engine.attention import whole_prompt_attention
    from engine.attention_fp8 import fp8_causal_attention, quantize_q
    from engine.kv_cache import to_kv_dtype

    heads, kv_heads, dim = 28, 4, 128
    gen = torch.Generator(device=dev).manual_seed(n)
    q, k, v = (torch.randn(n, h, dim, generator=gen, device=dev).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    flops = 2 * n * n * heads * dim  # QK^T and PV over the causal half
    want = whole_prompt_attention(q, k, v)
    got = fp8_causal_attention(q, k, v)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    bf16_ms = time_cuda(lambda: whole_prompt_attention(q, k, v), iters=5, warmup=2)
    fp8_ms = time_cuda(lambda: fp8_causal_attention(q, k, v), iters=5, warmup=2)
    convert_ms = time_cuda(lambda: (quantize_q(q), to_kv_dtype(k, torch.float8_e4m3fn),
                                    to_kv_dtype(v, torch.float8_e4m3fn)), iters=5, warmup=2)
    row = {"tokens": n, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "fp8_conversions_ms": convert_ms,
           "bf16_tflops": flops / bf16_ms / 1e9, "fp8_tflops_kernel": flops / (fp8_ms - convert_ms) / 1e9,
           "relative_error": err}
    print(f"{n:>6} bf16 {bf16_ms:7.2f} ms {row['bf16_tflops']:5.0f} TFLOP/s ({row['bf16_tflops'] / peak:.0%} of "
          f"{peak:.0f}) | fp8 {fp8_ms:7.2f} ms, of which q/k/v to e4m3 {convert_ms:.2f} ms, attention "
          f"{row['fp8_tflops_kernel']:5.0f} TFLOP/s | output's error against bf16 {err:.4f}", flush=True)
    return row


if __name__ == "__main__":
    main()
