"""`python -m bench.attention`: one layer's causal prefill attention at Qwen2.5-7B's shape through
each SDPA route, against the bf16 matrix rate, to choose the prefill path."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import measure_bf16_tflops, time_cuda


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    args = p.parse_args()
    dev = torch.device("cuda:0")
    peak = measure_bf16_tflops(dev)
    for n in args.tokens:
        measure(n, peak, dev)


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


if __name__ == "__main__":
    main()
