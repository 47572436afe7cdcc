"""Skinny matmul for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M of at most 16 rows.

At batch 1-16 a decode step's projections are pure weight streaming. cuBLAS picks split-K
kernels for the narrower ones (qkv, o_proj), reaching about two thirds of HBM bandwidth and
adding a reduce kernel; this kernel gives each program a strip of output columns and the whole
K loop, so one pass reads W once with no reduce. Rows past M are zero padding of the MMA tile,
so a row's result does not depend on how many other rows ride along (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 6


# Tiles chosen by `python -m bench.gemv --sweep` on an H200 (bench/NOTES.md). Chosen by the weight's
# shape only, never by the row count, so a row's result is the same at every batch size.
WIDE = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)  # gate_up, lm_head
TALL = GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)  # qkv: a few more columns than K
SQUARE = GemvConfig()                                                  # o_proj, down


def config_for(weight: torch.Tensor) -> GemvConfig:
    n, k = weight.shape
    return WIDE if n >= 4 * k else TALL if n > k else SQUARE


@triton.jit
def _gemv_kernel(X, W, BIAS, OUT, M, N, K, s_xm, s_wn, s_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    x_ptrs = X + offs_m[:, None] * s_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the caller)
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = OUT + offs_m[:, None] * s_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """16-bit operands only: the tiles are sized for them (float32 ones overflow shared memory at
    the 7B shape), and Triton would round float32 through TF32 where cuBLAS does not."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and x.shape[1] % config_for(weight).block_k == 0
            and x.stride(1) == 1 and weight.stride(1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K], bias [N] or None -> [M, N] in x's dtype."""
    cfg = cfg or config_for(weight)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
