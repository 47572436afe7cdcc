"""The skinny matmul on CUDA cores, for e4m3 weights at a few rows: out[M, N] = x[M, K] @ W[N, K]^T.

At one row the MMA tiles of `engine.kernels.gemv` read bf16 weights near HBM bandwidth but e4m3 ones
at about half of it: each e4m3 tile goes from shared memory to registers, is converted, and goes back
through shared memory in the MMA's operand layout, and one program gets through about 10 GB/s
(bench/NOTES.md). Here a tile goes from HBM straight to the registers that multiply it: each thread
loads 16 contiguous weights, converts them to float32 and multiplies them into its own float32
running sums with x; the sums are added across threads once, after the K loop. Nothing passes
through shared memory, so a program's loads are limited by the registers in flight, and an SM holds
many programs.

Each program computes `block_m` rows of x (1, 2 or 4) against a strip of output columns. It loads
and converts a weight once for all its rows, and keeps each row's sums in accumulators of its own:
a row's products and its sum across threads are the same instructions whatever `block_m` is, so a
row's result is the same bits at every M. Rows in separate programs (`block_m` 1 at two rows) read
the strip's weights once from HBM and again from L2, which costs the L2 re-reads and a second
conversion. A split of K (one row a program) writes float32 partial sums to a workspace and the
strip's last split to arrive adds them in split order, as in `engine.kernels.gemv`.

The engine (`engine.ops`) runs e4m3 projections here at 1-2 rows (`VECTOR_ROWS`), all the rows in each
program. So with FP8 weights a row's result is the same at batches of 1-2 and, separately, at 3-64 (the
64-row W8A8 tile); `min_decode_bucket` of 4 or more keeps every step on the MMA tile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import launch
from engine.kernels.arrivals import MAX_COUNTS, arrival_counts, last_split_sums
from engine.kernels.fused import bounded, silu_mul_rounded
from engine.kernels.gemv import ROUND_TYPES, shape_class

# e4m3 weights at this many rows or fewer run here. At 4 (also a batch of 3's graph) the 64-row W8A8 tile wins
# every shape at any rows a program (75.6 against 136.7 us a layer at best, gemv-vector-rows-a-program-h200.json)
VECTOR_ROWS = 2


@dataclass(frozen=True)
class VectorConfig:
    """A program's output columns, its weights a row a K step, warps, pipelined loads and K splits."""

    block_n: int = 16     # output columns a program
    block_k: int = 512    # weights a row a K step (16 a thread at 32 threads along K)
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    block_m: int = 1      # rows of x a program: each weight is loaded and converted once for all of them

    def fits(self, k: int) -> bool:
        return (k % self.block_k == 0 and k // self.block_k >= self.split_k and self.block_m in (1, 2, 4)
                and (self.block_m == 1 or self.split_k == 1))


# Tiles by the weight's shape class (`engine.kernels.gemv.shape_class`), from `python -m
# bench.micro.gemv_vector` on an H200 at one row (bench/results/gemv-vector-*-h200.json): against the
# MMA tile, down 28.9 -> 18.7 us, gate/up with SiLU·mul 42.7 -> 35.8, qkv 10.4 -> 6.4, o_proj 9.1 -> 5.1-5.4
# (4 columns and 2 warps; 5.6 with 8 and 4, gemv-vector-o-proj-h200.json: 7.0 against 7.2 at two rows).
# Splitting K did not pay (its partial sums cost more than the programs it adds); 512 weights a row
# a step beat 256 for the deep down projection (21.6-29.0 us at 256). The lm_head (a vocabulary)
# stays on the MMA tile, unmeasured here.
TILES: dict[str, VectorConfig] = {
    "wide": VectorConfig(block_n=8, block_k=256, num_stages=4),  # gate_up, gated
    "tall": VectorConfig(block_n=8, block_k=512, num_stages=3),  # qkv
    "square": VectorConfig(block_n=4, block_k=512, num_warps=2, num_stages=3),  # o_proj
    "deep": VectorConfig(block_n=8, block_k=512, num_stages=4),  # down
}


def config_for(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> VectorConfig | None:
    """The tile for x @ weight^T, or None where the MMA tiles or cuBLAS do it (more than VECTOR_ROWS
    rows, 16-bit weights, a shape without a tile, a K it does not divide). An unsplit tile takes all
    the rows in each program, so each weight is read from HBM and converted once a step."""
    if x.dim() != 2 or x.shape[0] > VECTOR_ROWS or weight.dtype != torch.float8_e4m3fn:
        return None
    cfg = TILES.get(shape_class(*weight.shape))
    if cfg is None or (gated and cfg.split_k > 1):
        return None
    if cfg.split_k == 1:
        cfg = replace(cfg, block_m=x.shape[0])
    return cfg if supports(x, weight, cfg) else None


@triton.jit
def _row_out(sums, sums_up, OUT, SCALE, BIAS, row, offs_n, n_ok, N, s_om,
             HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ROUND: tl.constexpr):
    """One row's epilogue: the weight's scales, the bias, the rounding, SiLU·mul when gated."""
    sums *= tl.load(SCALE + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        sums += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    out = sums.to(ROUND)
    if GATED:
        sums_up *= tl.load(SCALE + N + offs_n, mask=n_ok, other=0.0)
        out = silu_mul_rounded(out, sums_up.to(ROUND))
    tl.store(OUT + row * s_om + offs_n, out, mask=n_ok)


@triton.jit
def _products(acc, up, w, w_up, x, GATED: tl.constexpr):
    """A row's products with the step's weights (and the up half's where GATED), added to its sums."""
    acc += w.to(tl.float32) * x
    if GATED:
        up += w_up.to(tl.float32) * x
    return acc, up


@triton.jit
def _vector_kernel(X, W, SCALE, BIAS, OUT, PARTIAL, COUNTS, N, K, s_xm, s_wn, s_om,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, X_BOUND: tl.constexpr,
                   ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    # Up to 4 rows a program, each in its own accumulators (one per row, not a [rows, ...] tensor): a row's
    # products and its sum across threads are the same instructions whatever BLOCK_M is, so its bits are too
    if PDL:
        gdc_wait()
    row = tl.program_id(0) * BLOCK_M
    strip = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = strip * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_steps = K // BLOCK_K
    k_begin = (split * k_steps // SPLIT_K) * BLOCK_K
    k_end = ((split + 1) * k_steps // SPLIT_K) * BLOCK_K
    x_ptrs = X + row * s_xm + offs_k
    w_ptrs = W + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + k0).to(tl.float32)[None, :]
        x = bounded(x, X_BOUND)  # the layer's `input_bound`, as its capped e4m3 scales would saturate x
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc0 += w.to(tl.float32) * x
        w_up = w  # the up half's weights where GATED, else unused
        if GATED:
            w_up = tl.load(w_ptrs + N * s_wn + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            up0 += w_up.to(tl.float32) * x
        for r in tl.static_range(1, BLOCK_M):  # the same weights in registers, the next rows of x
            x = bounded(tl.load(x_ptrs + r * s_xm + k0).to(tl.float32)[None, :], X_BOUND)
            if r == 1:
                acc1, up1 = _products(acc1, up1, w, w_up, x, GATED)
            elif r == 2:
                acc2, up2 = _products(acc2, up2, w, w_up, x, GATED)
            else:
                acc3, up3 = _products(acc3, up3, w, w_up, x, GATED)
    if PDL:
        gdc_launch_dependents()
    sums = tl.sum(acc0, axis=1)
    last = True
    if SPLIT_K > 1:  # one row a program (`VectorConfig.fits`)
        sums, last = last_split_sums(sums, PARTIAL + row * N + offs_n, tl.num_programs(0) * N, n_ok,
                                     COUNTS + row * tl.num_programs(1) + strip, split, SPLIT_K)
    if last:
        _row_out(sums, tl.sum(up0, axis=1), OUT, SCALE, BIAS, row, offs_n, n_ok, N, s_om, HAS_BIAS, GATED, ROUND)
    if BLOCK_M > 1:
        _row_out(tl.sum(acc1, axis=1), tl.sum(up1, axis=1), OUT, SCALE, BIAS, row + 1, offs_n, n_ok, N, s_om,
                 HAS_BIAS, GATED, ROUND)
    if BLOCK_M > 2:
        _row_out(tl.sum(acc2, axis=1), tl.sum(up2, axis=1), OUT, SCALE, BIAS, row + 2, offs_n, n_ok, N, s_om,
                 HAS_BIAS, GATED, ROUND)
        _row_out(tl.sum(acc3, axis=1), tl.sum(up3, axis=1), OUT, SCALE, BIAS, row + 3, offs_n, n_ok, N, s_om,
                 HAS_BIAS, GATED, ROUND)


def supports(x: torch.Tensor, weight: torch.Tensor, cfg: VectorConfig) -> bool:
    """16-bit x [M, K] and e4m3 weight [N, K], both contiguous along K, K a whole number of the tile's
    steps, M of its rows a program, and (split) an arrival count for every row's strip."""
    k = weight.shape[1]
    return (x.dim() == 2 and x.dtype in ROUND_TYPES and weight.dtype == torch.float8_e4m3fn and x.shape[1] == k
            and cfg.fits(k) and x.shape[0] % cfg.block_m == 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and (cfg.split_k == 1 or x.shape[0] * triton.cdiv(weight.shape[0], cfg.block_n) <= MAX_COUNTS))


def gemv_vector(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cfg: VectorConfig,
                bias: torch.Tensor | None = None, gated: bool = False,
                out_dtype: torch.dtype | None = None, x_bound: float | None = None) -> torch.Tensor:
    """x [M, K] 16-bit, weight [N, K] e4m3 with `scale` [N] float32 (one per output row) -> [M, N] in
    x's dtype, stored as `out_dtype` after that rounding where given; `gated`: weight is [gate; up]
    and the result SiLU(gate) * up, [M, N / 2], rounded where the unfused path rounds; `x_bound`: the
    layer's `input_bound`, x clamped to +-x_bound."""
    m = x.shape[0]
    n, k = weight.shape
    assert supports(x, weight, cfg), f"no vector tile {cfg} for {tuple(x.shape)} x {tuple(weight.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == (n,)
    if gated:
        n //= 2
        assert cfg.split_k == 1 and bias is None, "the gated tile is unsplit and has no bias"
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    strips = triton.cdiv(n, cfg.block_n)
    partial = counts = out
    if cfg.split_k > 1:
        partial = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device)
    _vector_kernel[(m // cfg.block_m, strips, cfg.split_k)](
        x, weight, scale, bias if bias is not None else scale, out, partial, counts, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, GATED=gated, SPLIT_K=cfg.split_k, X_BOUND=x_bound or 0.0,
        ROUND=ROUND_TYPES[x.dtype], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        **launch.options())
    return out
