"""Skinny matmul for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M of at most 16 rows.

At batch 1-16 a decode step's projections are pure weight streaming. cuBLAS picks split-K
kernels for the narrower ones (qkv, o_proj), reaching about two thirds of HBM bandwidth and
adding a reduce kernel; this kernel gives each program a strip of output columns and the whole
K loop, so one pass reads W once with no reduce. Rows past M are zero padding of the MMA tile:
a row's result does not depend on how many other rows ride along, nor on the tile chosen for N.
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
def _gemv_kernel(X, DELTA, NORM_W, RESIDUAL, W, BIAS, OUT, M, N, K, s_xm, s_wn, s_om, up_offset, eps,
                 HAS_NORM: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m[:, None] < M
    row_offs = offs_m[:, None] * s_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    if HAS_NORM:  # rms_norm(x + delta) * norm_w, rounded where the unfused kernels round
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # first pass: each row's mean square (rows are L2-resident)
            x = tl.load(X + row_offs + k0, mask=m_ok, other=0.0)
            if HAS_DELTA:
                x = (x.to(tl.float32) + tl.load(DELTA + row_offs + k0, mask=m_ok, other=0.0).to(tl.float32)).to(
                    x.dtype)
                if pid == 0:
                    tl.store(RESIDUAL + row_offs + k0, x, mask=m_ok)
            xf = x.to(tl.float32)
            sq += tl.sum(xf * xf, 1)
        rstd = tl.rsqrt(sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the caller)
        x = tl.load(X + row_offs + k0, mask=m_ok, other=0.0)
        if HAS_NORM:
            if HAS_DELTA:
                x = (x.to(tl.float32) + tl.load(DELTA + row_offs + k0, mask=m_ok, other=0.0).to(tl.float32)).to(
                    x.dtype)
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            x = (tl.load(NORM_W + offs_k + k0).to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc = tl.dot(x, tl.trans(w), acc)
        if GLU:  # the up projection's matching rows, half the weight further on
            w_up = tl.load(w_ptrs + up_offset * s_wn + k0, mask=n_ok[:, None], other=0.0,
                           eviction_policy="evict_first")
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dt = OUT.dtype.element_ty
    if GLU:  # silu(gate) * up, each rounded as the unfused silu_mul kernel does
        g = acc.to(dt).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    tl.store(OUT + offs_m[:, None] * s_om + offs_n[None, :], acc.to(dt), mask=m_ok & n_ok[None, :])


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % config_for(weight).block_k == 0
            and x.is_contiguous() and weight.stride(1) == 1 and x.dtype == weight.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_cols: int, *,
            delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            residual: torch.Tensor | None = None, glu: bool = False, cfg: GemvConfig | None = None) -> torch.Tensor:
    cfg = cfg or config_for(weight)
    m, k = x.shape
    out = torch.empty(m, out_cols, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(out_cols, cfg.block_n),)](
        x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        residual if residual is not None else x, weight, bias if bias is not None else weight, out,
        m, out_cols, k, x.stride(0), weight.stride(0), out.stride(0), out_cols if glu else 0, eps,
        HAS_NORM=norm_weight is not None, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, GLU=glu,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K], bias [N] or None -> [M, N] in x's dtype."""
    return _launch(x, weight, bias, weight.shape[0], cfg=cfg)


def norm_gemv(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None,
              glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + delta) * norm_weight), x + delta) in one kernel; with `glu` the weight
    holds gate then up rows and the result is silu(gate) * up [M, N / 2]."""
    residual = torch.empty_like(x) if delta is not None else x
    out = _launch(x, weight, bias, weight.shape[0] // 2 if glu else weight.shape[0], delta=delta,
                  norm_weight=norm_weight, eps=eps, residual=residual, glu=glu)
    return out, residual
