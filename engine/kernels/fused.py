"""Small fused kernels for the decode/prefill forward on CUDA: each replaces several PyTorch ops
(and kernel launches) and rounds to the model dtype where PyTorch's unfused ops would, so the
results match the eager PyTorch path to the last bit or nearly so."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import launch

_E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest magnitude: a quantized row is scaled so its own largest is this
_TINY = tl.constexpr(1.1754943508222875e-38)  # the smallest normal float32: an all-zero row's scale


@triton.jit
def e4m3_scale(amax, BOUND: tl.constexpr):
    """A row's float32 scale from its largest magnitude: every per-token quantization's (the
    kernels here, `fp8_quant`'s and the skinny matmul's). BOUND > 0 (the layer's `input_bound`,
    fbgemm_fp8's `activation_scale_ub`) caps the magnitude the scale takes: larger values saturate."""
    if BOUND > 0:
        amax = tl.minimum(amax, BOUND)
    return tl.maximum(amax / _E4M3_MAX, _TINY)


@triton.jit
def bounded(x, BOUND: tl.constexpr):
    """x clamped to +-BOUND where BOUND > 0 (the layer's `input_bound`): what a per-token scale capped by
    `e4m3_scale` does to x's larger magnitudes, for the tiles that multiply 16-bit x unquantized."""
    if BOUND > 0:
        x = tl.minimum(tl.maximum(x, -BOUND), BOUND)
    return x


@triton.jit
def to_e4m3_range(x, scale):
    """float32 x over its row's `e4m3_scale`, clamped to e4m3's range, for the cast to e4m3."""
    return tl.minimum(tl.maximum(x / scale, -_E4M3_MAX), _E4M3_MAX)


@triton.jit
def store_e4m3_row(h, Q, SCALE, mask, BOUND: tl.constexpr):
    """One row's float32 values `h` (masked lanes zero) to e4m3 at Q and its scale (float32) at SCALE,
    the scale bounded by BOUND (`e4m3_scale`)."""
    scale = e4m3_scale(tl.max(tl.abs(h), axis=0), BOUND)
    tl.store(SCALE, scale)
    tl.store(Q, to_e4m3_range(h, scale).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, OUT, Q, SCALE, N, eps, HAS_DELTA: tl.constexpr, QUANTIZE: tl.constexpr,
                         BOUND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0)  # a weight no kernel writes: loaded while the one before drains
    if PDL:  # the kernel before has finished (engine.kernels.launch)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(X + row * N + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # residual += delta, rounded to the model dtype as PyTorch's add would
        x = (x.to(tl.float32) + tl.load(DELTA + row * N + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(X + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    tl.store(OUT + row * N + offs, out, mask=mask)
    if QUANTIZE:  # the rounded output's e4m3 row too, as `fp8_quant.quantize_rows` would write it
        store_e4m3_row(out.to(tl.float32), Q + row * N + offs, SCALE + row, mask, BOUND)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None,
                 quantize: bool = False, bound: float | None = None,
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """x [T, N] (updated in place to x + delta when delta is given) -> (rms_norm(x) * weight, None);
    with `quantize`, the second is that output's `fp8_quant.quantize_rows(out, bound)` (e4m3 [T, N],
    float32 scales [T, 1]), the same bits, from the same kernel: the x of a W8A8 projection that follows."""
    rows, n = x.shape
    out = torch.empty_like(x)
    q = scale = out
    if quantize:
        q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
        scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, out, q, scale, n, eps,
                                  HAS_DELTA=delta is not None, QUANTIZE=quantize, BOUND=bound or 0.0,
                                  BLOCK=triton.next_power_of_2(n), num_warps=8, **launch.options())
    return out, ((q, scale) if quantize else None)


@triton.jit
def silu_mul_rounded(g, u):
    """SiLU(g) * u for 16-bit g and u, rounded to their dtype where PyTorch's SiLU and product round."""
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_kernel(GU, OUT, INTER, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    g = tl.load(GU + row * 2 * INTER + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * 2 * INTER + INTER + offs, mask=mask, other=0.0)
    tl.store(OUT + row * INTER + offs, silu_mul_rounded(g, u), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4,
                                                         **launch.options())
    return out


ROPE_BLOCK_T = 16  # tokens a program for prefills (`python -m bench.micro.rope`)


@triton.jit
def _rope_store_kernel(QKV, POS, COS, SIN, Q_OUT, K_OUT, V_OUT, KV, SLOTS, T,
                       s_qkv, s_kv_kind, s_kv_slot, s_kv_head, s_cos,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       WRITE_V: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """One head of BLOCK_T tokens per program (one token's head alone is too little work: at 32k
    tokens a program per (token, head) ran at a quarter of the memory bandwidth). The head is the
    fastest-moving program id, so the programs of one token block run together and read its cos
    and sin rows from L2 after the first; only the tables' first halves are read, as the second
    halves repeat them (`RotaryTable`: cat(freqs, freqs))."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    h = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)[None, :]
    live = (t < T)[:, None]
    src = QKV + t[:, None] * s_qkv + h * HEAD_DIM
    x1 = tl.load(src + offs, mask=live)
    x2 = tl.load(src + half + offs, mask=live)
    slot = tl.load(SLOTS + t, mask=t < T, other=0).to(tl.int64)[:, None]
    if h >= NUM_HEADS + NUM_KV_HEADS:  # V: stored as is
        vh = h - NUM_HEADS - NUM_KV_HEADS
        # its own name: a variable's type must be one in both branches, and the pool's may be e4m3
        cache_v = KV + s_kv_kind + slot * s_kv_slot + vh * s_kv_head
        # an e4m3 pool: Triton converts to it from float32 only (exact for a 16-bit pool)
        tl.store(cache_v + offs, x1.to(tl.float32).to(KV.dtype.element_ty), mask=live)
        tl.store(cache_v + half + offs, x2.to(tl.float32).to(KV.dtype.element_ty), mask=live)
        if WRITE_V:
            out = V_OUT + (t[:, None] * NUM_KV_HEADS + vh) * HEAD_DIM
            tl.store(out + offs, x1, mask=live)
            tl.store(out + half + offs, x2, mask=live)
    else:
        pos = tl.load(POS + t, mask=t < T, other=0).to(tl.int64)[:, None]
        dt = x1.dtype
        c = tl.load(COS + pos * s_cos + offs, mask=live).to(dt).to(tl.float32)
        s = tl.load(SIN + pos * s_cos + offs, mask=live).to(dt).to(tl.float32)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # q * cos + rotate_half(q) * sin, each product and the sum rounded as in PyTorch
        o1 = ((a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
        if h < NUM_HEADS:
            dst = Q_OUT + (t[:, None] * NUM_HEADS + h) * HEAD_DIM
        else:
            kh = h - NUM_HEADS
            dst = K_OUT + (t[:, None] * NUM_KV_HEADS + kh) * HEAD_DIM
            cache = KV + slot * s_kv_slot + kh * s_kv_head
            tl.store(cache + offs, o1.to(tl.float32).to(KV.dtype.element_ty), mask=live)
            tl.store(cache + half + offs, o2.to(tl.float32).to(KV.dtype.element_ty), mask=live)
        tl.store(dst + offs, o1, mask=live)
        tl.store(dst + half + offs, o2, mask=live)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, rows: int | None = None,
                   block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) D] -> rotated q [T, H, D], k [T, Hkv, D], and v (a view); K and V are
    also written into the pool layer at `slots`. With `rows` (>= T), q, k and v are [rows, ...]
    buffers whose rows past T are zero (padded whole-prompt attention, `engine.attention`)."""
    tokens = qkv.shape[0]
    n = tokens if rows is None else rows
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    if rows is not None:
        v = torch.empty_like(k)
        for t in (q, k, v):
            t[tokens:].zero_()
    if block_t is None:  # decode steps (in CUDA graphs) keep a program per token
        block_t = 1 if tokens <= 64 else max(ROPE_BLOCK_T, triton.next_power_of_2(triton.cdiv(tokens, 65535)))
    _rope_store_kernel[(num_heads + 2 * num_kv_heads, triton.cdiv(tokens, block_t))](
        qkv, positions, cos, sin, q, k, v, kv_layer, slots, tokens, qkv.stride(0), kv_layer.stride(0),
        kv_layer.stride(1), kv_layer.stride(2), cos.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, WRITE_V=rows is not None, BLOCK_T=block_t, num_warps=1 if block_t == 1 else 4,
        **launch.options())
    return q, k, v


@triton.jit
def _embed_fed_kernel(IDS, SOURCES, PREVIOUS, W, OUT, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(SOURCES + row).to(tl.int64)
    fed = tl.load(PREVIOUS + tl.maximum(src, 0))  # PREVIOUS holds one token at least
    token = tl.where(src >= 0, fed, tl.load(IDS + row).to(tl.int64))
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    tl.store(OUT + row * H + offs, tl.load(W + token * H + offs, mask=mask), mask=mask)


def embed_fed(ids: torch.Tensor, sources: torch.Tensor, previous: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The embedding rows of the step's tokens, a row's token being previous[sources[i]] where
    sources[i] >= 0 and ids[i] elsewhere: the token feed and the gather as one launch."""
    rows, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty(rows, hidden, dtype=weight.dtype, device=weight.device)
    _embed_fed_kernel[(rows,)](ids, sources, previous, weight, out, hidden, BLOCK=triton.next_power_of_2(hidden),
                               num_warps=4, **launch.options())
    return out
