"""Skinny matmul for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M of at most 64 rows,
and the MLP's gate/up projection with SiLU·mul in its epilogue (`gemv_silu`).

At batch 1-16 a decode step's projections are pure weight streaming. cuBLAS picks split-K
kernels for the narrower ones (qkv, o_proj), reaching about two thirds of HBM bandwidth and
adding a reduce kernel. Here each program gives a strip of output columns a slice of the K loop;
the narrow shapes split K so that every SM streams weights (qkv has 72 column strips for 132
SMs). A split's partial sums go to a float32 workspace, and the strip's last program to finish
(an atomic count) adds them in split order, so the result is deterministic with no second kernel;
where the split count does not divide the K steps, shares differ by one step. With `gemv_argmax`
(the lm_head of a greedy step) each program also keeps its strip's best value a row, and a small
kernel picks the row's token from those, so the float32 logits are written but not read again.
Rows past M are zero padding of the MMA tile, so a row's result does not depend on how many
other rows ride along (tested).

FP8 weights (e4m3 with one float32 scale per output row, `engine.fp8`) stream at half the bytes:
each tile is converted to the activations' 16-bit type in registers (exact: every e4m3 value is a
bf16 and an fp16 value), the MMA accumulates in float32 as for 16-bit weights, and the row scales
multiply the sums before the bias and the rounding (W8A16). A tile with `quantize_x` instead takes
x to e4m3 with one scale a row (largest magnitude to 448, as `fp8_quant.quantize_rows`), so the MMA
runs on FP8 tensor cores with no conversion of the weights, and both scales multiply the sums (W8A8,
as `torch._scaled_mm` with row-wise scales). On the 16-row tile each program quantizes x itself (a
pass over x for the rows' largest magnitudes, then each tile as it is read): one launch, and a row's
result still independent of the others; on the 64-row tile (e4m3 weights from 3 rows on, `tile_rows`)
x comes quantized (by `fp8_quant.quantize_rows`, or given as `x_e4m3` by the norm or the attention's
merge before the projection), since 64 rows of x read by every program would cost more than the
weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import fp8_quant, launch
from engine.kernels.arrivals import MAX_COUNTS, arrival_counts, last_split_sums
from engine.kernels.fused import bounded, e4m3_scale, silu_mul_rounded, to_e4m3_range

MAX_ROWS = 16         # rows of the MMA tile at decode batches of 1-16 (16-bit weights)
WIDE_ROWS = 64        # the tile's rows from 17 on, for the shapes `WIDE_ROW_TILES` names
# e4m3 weights take the 64-row W8A8 tiles from 3 rows on: on the 16-row tiles, which convert e4m3 to 16 bits,
# batches of 8-16 ran slower than 32; batch 8 3.715 -> 3.006 ms a step on an H200, batch 4 3.637 -> 3.178
# (bench/results/engine-fp8-rows-ab-h200.json)
FP8_NARROW_ROWS = 2

# how the kernel takes x (`_gemv_kernel`'s X_MODE)
X_16BIT = tl.constexpr(0)
X_E4M3 = tl.constexpr(1)
X_QUANTIZE = tl.constexpr(2)
X_F16 = tl.constexpr(3)
F16_SAFE = tl.constexpr(32768.0)  # a tile's x is halved until its largest magnitude is at most this
ROUND_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # the model dtype as the kernels round to it


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 6
    split_k: int = 1  # programs along K per column strip
    quantize_x: bool = False  # e4m3 weights: x to e4m3 per row too, for FP8 tensor cores (W8A8)
    f16_mma: bool = False  # e4m3 weights, 16-bit x: the products in float16 (`_gemv_kernel`'s X_F16)
    strip_n: int = 0  # output columns a program stores, at most block_n (0: block_n); the rest of its tile is
    # masked, so a strip count can fit the SMs (the weight bytes a program reads shrink with its strip)
    max_registers: int = 0  # a thread's registers capped (Triton's maxnreg; 0: the compiler's count), so more
    # programs share an SM

    @property
    def strip(self) -> int:
        """Output columns a program covers."""
        return self.strip_n or self.block_n

    def fits(self, k: int) -> bool:
        """Whether a K of `k` is whole `block_k` steps, at least one for each split."""
        return k % self.block_k == 0 and k // self.block_k >= self.split_k


# Tiles chosen by `python -m bench.micro.gemv --sweep` on an H200, by the weight's shape class (the
# timings behind each: bench/NOTES.md, "Where the code's constants come from"): one tile for every
# batch of 1-16 rows, so a row's result is the same at each of them.
_NARROW_WIDE = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
NARROW_ROW_TILES: dict[str, GemvConfig] = {
    "wide": _NARROW_WIDE,   # gate_up
    "vocab": _NARROW_WIDE,  # lm_head
    "tall": GemvConfig(block_n=32, block_k=128, num_warps=4, num_stages=3, split_k=3),    # qkv
    "square": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=7),  # o_proj
    "deep": GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=2),    # down
}


# Batches of 17-64 rows: a 64-row tile where it beats cuBLAS (`python -m bench.micro.gemv --sweep --rows 64`);
# qkv and o_proj stay with cuBLAS.
WIDE_ROW_TILES: dict[str, GemvConfig] = {
    "vocab": GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=4),
    "wide": GemvConfig(block_n=128, block_k=64, num_warps=4, num_stages=3),
    "deep": GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6, split_k=2),
}


# e4m3 weights (`python -m bench.micro.gemv --fp8 --gated --sweep`, bench/results/gemv-fp8-sweep-h200.json and
# gemv-fp8-w8a8-sweep-h200.json). At 1-16 rows the 16-bit tiles but for two shapes: down 47.8 -> 30.0 us and
# qkv 11.4 -> 10.4 us on FP8 tiles with bf16 x (W8A16); W8A8 won only for gate/up there (50.6 -> 48.0 us, a
# batch-1 step 0.05 ms shorter, but batch 8 0.09 ms longer: each program reads every row of x for its
# scales) and is not taken (bench/NOTES.md). At 17-64 rows every shape W8A8, beside
# `torch._scaled_mm` at 64 rows (its own x quantization not counted): qkv 10.7 against 15.7 us, o_proj 10.2
# against 12.3, gate/up with SiLU·mul 41.3 against 54.4, down 34.1 against 46.7.
# gate/up and down then multiply in float16 (`f16_mma`, bench/results/gemv-fp8-f16-sweep-h200.json):
# gate/up with SiLU·mul 53.7 -> 42.6 us, down 30.1 -> 28.9 us at one row. Since then the 16-row tiles run e4m3
# weights only at 1-2 rows where the CUDA-core tiles do not (`gemv_vector`), and the 64-row ones from 3.
FP8_NARROW_ROW_TILES: dict[str, GemvConfig] = {
    **NARROW_ROW_TILES,
    "wide": GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, f16_mma=True),  # gate_up (gated: 64)
    "tall": GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=4),  # qkv
    "deep": GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4, f16_mma=True),  # down
}
# Strips narrower than the tile (`python -m bench.micro.gemv --fp8 --sweep --rows 64 --wide-strip-n ...`,
# bench/results/gemv-fp8-w8a8-strips-h200.json): gate/up's 48-column gated strips, 395 programs for three an
# SM, 40.2 -> 37.6 us. down's best (56 columns: 26.0 -> 25.5 us) is not taken, a gain within the spread that
# fits one shape's strip count to the SMs; qkv and o_proj lost on them. o_proj on 32-column tiles, 112 programs
# where 64 columns made 56 (bench/results/gemv-fp8-o-proj-sweep-h200.json, x's e4m3 rows given): 6.9-7.1 -> 6.0-6.1 us.
FP8_WIDE_ROW_TILES: dict[str, GemvConfig] = {
    "wide": GemvConfig(block_n=128, block_k=128, num_warps=4, num_stages=3, quantize_x=True,
                       strip_n=48),  # gate_up, gated (the gated tile 64 columns, its strip 48)
    "tall": GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=5, quantize_x=True),   # qkv
    "square": GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=6, quantize_x=True),  # o_proj
    "deep": GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=5, split_k=2, quantize_x=True),  # down
}


def shape_class(n: int, k: int) -> str:
    """The weight's class for tile choice: its output columns N against its input K."""
    if n >= 16 * k:  # a vocabulary (the lm_head: 42 x the hidden size for Qwen2.5-7B; gate/up is 5-11 x)
        return "vocab"
    return "wide" if n >= 4 * k else "tall" if n > k else "square" if n == k else "deep"


def tile_rows(weight: torch.Tensor, rows: int) -> int:
    """The MMA tile's rows for `rows` rows of x against `weight`: 16 (MAX_ROWS) or 64 (WIDE_ROWS).
    A row's result is the same at every M with one tile."""
    narrow = FP8_NARROW_ROWS if weight.dtype == torch.float8_e4m3fn else MAX_ROWS
    return MAX_ROWS if rows <= narrow else WIDE_ROWS


def config_for(weight: torch.Tensor, rows: int = 1, static_x: bool = False) -> GemvConfig | None:
    """The tile for `weight` at `rows` rows; None where cuBLAS does it better (or rows > WIDE_ROWS).
    `static_x`: x was quantized with an FP8 checkpoint's static input scale, so is not again."""
    if rows > WIDE_ROWS:
        return None
    n, k = weight.shape
    narrow = tile_rows(weight, rows) == MAX_ROWS
    if weight.dtype == torch.float8_e4m3fn:
        tiles = FP8_NARROW_ROW_TILES if narrow else FP8_WIDE_ROW_TILES
    else:
        tiles = NARROW_ROW_TILES if narrow else WIDE_ROW_TILES
    cfg = tiles.get(shape_class(n, k))
    if cfg is None:
        return None
    if not cfg.fits(k):  # too short to split: one program per strip
        cfg = replace(cfg, split_k=1)
    return replace(cfg, quantize_x=False) if static_x else cfg


@triton.jit
def _gemv_kernel(X, X_SCALE, W, SCALE, BIAS, OUT, PARTIAL, COUNTS, BEST, BEST_COL, M, N, K, s_xm, s_wn, s_om,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ARGMAX: tl.constexpr,
                 SPLIT_K: tl.constexpr, X_MODE: tl.constexpr, X_BOUND: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIP_N: tl.constexpr,
                 PDL: tl.constexpr):
    """X_MODE: X_16BIT (16-bit x, times 16-bit or e4m3 weights), X_E4M3 (x already e4m3 with a
    float32 scale a row in X_SCALE) or X_QUANTIZE (16-bit x quantized per row here, as
    `fp8_quant.quantize_rows` does); X_BOUND > 0: the layer's `input_bound`, x clamped to +-X_BOUND
    (16-bit x) or its row scales capped at X_BOUND / 448 (x quantized here; e4m3 x comes bounded);
    ROUND: the model's dtype, to which the output is rounded.
    X_F16: bfloat16 x and e4m3 weights multiplied in float16, which holds every e4m3 value and every
    bfloat16 one from 2^-14 to 65504 exactly, and takes e4m3 in one conversion a pair of values where
    bfloat16 takes three; a row of a tile whose x passes F16_SAFE is scaled by a power of two (exact)
    and its products by the inverse."""
    if PDL:  # the kernel before has finished (engine.kernels.launch)
        gdc_wait()
    strip = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = strip * STRIP_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    if STRIP_N < BLOCK_N:  # the tile's columns past the strip are the next program's
        n_ok = n_ok & (tl.arange(0, BLOCK_N) < STRIP_N)
    m_ok = offs_m < M
    # A split's share of the K steps; shares differ by at most one step where SPLIT_K does not divide them
    k_steps = K // BLOCK_K
    k_begin = (split * k_steps // SPLIT_K) * BLOCK_K
    k_end = ((split + 1) * k_steps // SPLIT_K) * BLOCK_K
    x_ptrs = X + offs_m[:, None] * s_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :]
    x_scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if X_MODE == X_E4M3:
        x_scale = tl.load(X_SCALE + offs_m, mask=m_ok, other=1.0)
    if X_MODE == X_QUANTIZE:  # each row's largest magnitude over the whole of K (x is small and in L2)
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0).to(tl.float32)),
                                           axis=1))
        x_scale = e4m3_scale(amax, X_BOUND)  # as `quantize_rows` quantizes
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up rows, N rows below the gate's
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
        if X_BOUND > 0 and (X_MODE != X_E4M3 and X_MODE != X_QUANTIZE):  # 16-bit x (one "and" a pair, for older Triton)
            x = bounded(x.to(tl.float32), X_BOUND).to(x.dtype)
        if X_MODE == X_QUANTIZE:
            x = to_e4m3_range(x.to(tl.float32), x_scale[:, None]).to(W.dtype.element_ty)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        if X_MODE == X_F16:
            big = tl.max(tl.abs(x.to(tl.float32)), axis=1)
            pow2 = tl.exp2(tl.maximum(tl.ceil(tl.log2(big / F16_SAFE)), 0.0))  # 1 unless the row passes F16_SAFE
            x16 = (x.to(tl.float32) / pow2[:, None]).to(tl.float16)
            acc += tl.dot(x16, tl.trans(w.to(tl.float16))) * pow2[:, None]
            if GATED:
                w_up = tl.load(w_ptrs + N * s_wn + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                acc_up += tl.dot(x16, tl.trans(w_up.to(tl.float16))) * pow2[:, None]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # 16-bit x: FP8 weights converted in registers
            if GATED:
                w_up = tl.load(w_ptrs + N * s_wn + k0, mask=n_ok[:, None], other=0.0,
                               eviction_policy="evict_first")
                acc_up = tl.dot(x, tl.trans(w_up.to(x.dtype)), acc_up)
    if PDL:
        gdc_launch_dependents()
    last = True
    if SPLIT_K > 1:
        acc, last = last_split_sums(acc, PARTIAL + offs_m[:, None] * N + offs_n[None, :], BLOCK_M * N,
                                    m_ok[:, None] & n_ok[None, :], COUNTS + strip, split, SPLIT_K)
    if last:
        if HAS_SCALE:  # FP8 weights: each output row's scale (and e4m3 x's row scales), on the float32 sums
            acc *= tl.load(SCALE + offs_n, mask=n_ok, other=0.0)[None, :] * x_scale[:, None]
            if GATED:
                acc_up *= tl.load(SCALE + N + offs_n, mask=n_ok, other=0.0)[None, :] * x_scale[:, None]
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(ROUND)  # rounded to the model dtype even where OUT is float32 (logits)
        if GATED:  # each projection rounded, then SiLU·mul as the unfused kernel rounds it
            out = silu_mul_rounded(out, acc_up.to(ROUND))
        out_ptrs = OUT + offs_m[:, None] * s_om + offs_n[None, :]
        tl.store(out_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])
        if ARGMAX:  # each row's largest value in the strip and its first column, for `_argmax_kernel`
            vals = tl.where(n_ok[None, :], out.to(tl.float32), float("-inf"))
            best, col = tl.max(vals, axis=1, return_indices=True, return_indices_tie_break_left=True)
            strips = tl.num_programs(0)
            tl.store(BEST + offs_m * strips + strip, best, mask=m_ok)
            tl.store(BEST_COL + offs_m * strips + strip, strip * STRIP_N + col, mask=m_ok)


@triton.jit
def _argmax_kernel(BEST, BEST_COL, TOKENS, STRIPS, STRIPS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Each row's first column holding its largest value, from the strips' candidates: the lowest
    strip among equal maxima, whose candidate is its own first, so ties go as torch.argmax's do."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, STRIPS_PAD)
    vals = tl.load(BEST + row * STRIPS + offs, mask=offs < STRIPS, other=float("-inf"))
    _, strip = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    col = tl.load(BEST_COL + row * STRIPS + strip)
    tl.store(TOKENS + row, col.to(tl.int64))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """16-bit activations with weights of their dtype or e4m3 (given with their row scales): the
    tiles are sized for them (float32 ones overflow shared memory at the 7B shape), and Triton would
    round float32 through TF32 where cuBLAS does not."""
    k = weight.shape[1]
    cfg = config_for(weight, x.shape[0]) if x.dim() == 2 else None
    return (cfg is not None and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype in (x.dtype, torch.float8_e4m3fn)
            and x.shape[1] == k and cfg.fits(k) and x.stride(1) == 1 and weight.stride(1) == 1
            and triton.cdiv(weight.shape[0], cfg.strip) <= MAX_COUNTS)


E4m3Rows = tuple[torch.Tensor, torch.Tensor]  # x's e4m3 rows [M, K] and float32 scales [M, 1], as `quantize_rows`'


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: GemvConfig | None = None, out_dtype: torch.dtype | None = None,
         scale: torch.Tensor | None = None, x_e4m3: E4m3Rows | None = None,
         x_bound: float | None = None) -> torch.Tensor:
    """x [M, K] (M <= 64), weight [N, K], bias [N] or None -> [M, N] in x's dtype, or stored as
    `out_dtype` after that rounding (float32 logits without a conversion kernel). Rows run in a 16-row
    or a 64-row tile (`tile_rows`: 16-bit weights 1-16 and 17-64, e4m3 1-2 and 3-64), so a row's result
    is the same for every M of its class. An e4m3 weight comes with `scale` [N] (float32), one per
    output row; `x_e4m3`, x's rows already quantized, where the tile quantizes x first (the 64-row one);
    `x_bound`, the layer's `input_bound` (x clamped to +-x_bound, or its e4m3 scales capped)."""
    cfg = cfg or config_for(weight, x.shape[0])
    assert cfg is not None, f"no tile for {tuple(weight.shape)} at {x.shape[0]} rows: cuBLAS does these"
    return _launch(x, weight, bias, cfg, gated=False, out_dtype=out_dtype, scale=scale, x_e4m3=x_e4m3,
                   x_bound=x_bound)[0]


def gemv_argmax(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
                cfg: GemvConfig | None = None, tokens: torch.Tensor | None = None,
                scale: torch.Tensor | None = None, x_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`gemv` (no bias) and each row's argmax over the stored values ([M] int64, the first column
    among equal maxima, as torch.argmax): the lm_head of a greedy decode step, whose epilogue keeps
    each strip's best so the logits are not read again; the tokens go to `tokens` [M] when given.
    Unsplit tiles only."""
    cfg = cfg or config_for(weight, x.shape[0])
    assert cfg is not None and cfg.split_k == 1, f"no unsplit tile for {tuple(weight.shape)} at {x.shape[0]} rows"
    out, picked = _launch(x, weight, None, cfg, gated=False, out_dtype=out_dtype, argmax=True, tokens=tokens,
                          scale=scale, x_bound=x_bound)
    assert picked is not None
    return out, picked


def gemv_silu(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig | None = None,
              scale: torch.Tensor | None = None, x_e4m3: E4m3Rows | None = None,
              x_bound: float | None = None) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) for weight [2I, K] = [gate; up] -> [M, I], with the same rounding
    as `gemv` followed by SiLU·mul: each program streams a strip of gate rows and the matching up rows."""
    cfg = cfg or gated_config_for(weight, x.shape[0])
    assert cfg is not None, f"no gated tile for {tuple(weight.shape)} at {x.shape[0]} rows"
    return _launch(x, weight, None, cfg, gated=True, scale=scale, x_e4m3=x_e4m3, x_bound=x_bound)[0]


def gated_config_for(weight: torch.Tensor, rows: int = 1, static_x: bool = False) -> GemvConfig | None:
    """`config_for`'s tile with half the columns, since each program streams two strips; unsplit. A
    `strip_n` of the tile is the gated tile's strip."""
    cfg = config_for(weight, rows, static_x)
    if cfg is None or cfg.split_k > 1 or weight.shape[0] % 2:
        return None
    return replace(cfg, block_n=cfg.block_n // 2)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
            gated: bool, out_dtype: torch.dtype | None = None,
            argmax: bool = False, tokens: torch.Tensor | None = None,
            scale: torch.Tensor | None = None,
            x_e4m3: E4m3Rows | None = None,
            x_bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    assert (scale is not None) == (weight.dtype == torch.float8_e4m3fn), "e4m3 weights come with their row scales"
    assert scale is None or (scale.dtype == torch.float32 and scale.shape == (weight.shape[0],))
    assert m <= WIDE_ROWS, f"{m} rows: the skinny matmul takes at most {WIDE_ROWS}"
    assert not cfg.quantize_x or scale is not None, "x is quantized for e4m3 weights only"
    n, k = weight.shape
    if gated:
        n //= 2
        assert cfg.split_k == 1 and bias is None, "the gated tile is unsplit and has no bias"
    assert cfg.fits(k), f"K={k} does not split as {cfg}"
    block_m = tile_rows(weight, m)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    assert cfg.strip <= cfg.block_n, f"a strip of {cfg.strip} columns in a {cfg.block_n}-column tile"
    strips = triton.cdiv(n, cfg.strip)
    partial = counts = best = best_col = out
    if cfg.split_k > 1:
        partial = torch.empty(cfg.split_k, block_m, n, dtype=torch.float32, device=x.device)
        counts = arrival_counts(x.device)
    if argmax:
        assert cfg.split_k == 1 and not gated, "the argmax epilogue is for unsplit, ungated tiles"
        best = torch.empty(m, strips, dtype=torch.float32, device=x.device)
        best_col = torch.empty(m, strips, dtype=torch.int32, device=x.device)
        if tokens is None:
            tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    # e4m3 x: quantized in the kernel on the 16-row tile; on the 64-row one, by one kernel first (each
    # program would otherwise read all 64 rows of x for their scales)
    x_mode, x_in, x_scale = X_F16 if cfg.f16_mma else X_16BIT, x, out
    assert not cfg.f16_mma or (scale is not None and not cfg.quantize_x), "float16 products are for e4m3 weights"
    if cfg.quantize_x:
        x_mode = X_QUANTIZE if block_m == MAX_ROWS else X_E4M3
        if x_mode == X_E4M3:
            x_in, x_scale = x_e4m3 if x_e4m3 is not None else fp8_quant.quantize_rows(x, x_bound)
    assert x_e4m3 is None or x_mode == X_E4M3, "e4m3 rows are taken where the tile quantizes x first (64-row tile)"
    _gemv_kernel[(strips, cfg.split_k)](
        x_in, x_scale, weight, scale if scale is not None else out, bias if bias is not None else weight, out,
        partial, counts, best, best_col, m, n, k,
        x_in.stride(0), weight.stride(0), out.stride(0),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, GATED=gated, ARGMAX=argmax, SPLIT_K=cfg.split_k,
        X_MODE=x_mode, X_BOUND=x_bound or 0.0, ROUND=ROUND_TYPES[x.dtype],
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STRIP_N=cfg.strip, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch.options(cfg.max_registers))
    if not argmax:
        return out, None
    _argmax_kernel[(m,)](best, best_col, tokens, strips, STRIPS_PAD=triton.next_power_of_2(strips), num_warps=4,
                         **launch.options())
    return out, tokens
