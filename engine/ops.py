"""The forward's elementwise pieces: fused Triton kernels on CUDA, plain PyTorch elsewhere.

Both paths round to the model dtype at the same points (as transformers' Qwen2 does), so the
CPU path matches transformers and the CUDA path matches itself eager or graphed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.fp8 import (
    Fp8Linear,
    bound_rows,
    fake_quantize,
    scaled_matmul,
    scaled_matmul_quantized,
    scaled_mm_supports,
)
from engine.kv_cache import as_bytes, to_kv_dtype

try:
    from engine.kernels import fp8_quant as _fp8_quant
    from engine.kernels import fused as _fused
    from engine.kernels import gemv as _gemv
    from engine.kernels import gemv_vector as _gemv_vector
    from engine.kernels import launch as _launch
except ImportError:  # no Triton: CPU-only installs
    _fp8_quant = None  # type: ignore[assignment]
    _fused = None  # type: ignore[assignment]
    _gemv = None  # type: ignore[assignment]
    _gemv_vector = None  # type: ignore[assignment]
    _launch = None  # type: ignore[assignment]
try:
    from engine.kernels import gate_up_silu as _gate_up
except (ImportError, AttributeError):  # no Triton, or one without Gluon's Hopper language
    _gate_up = None  # type: ignore[assignment]

# The fused gate/up kernel from this many rows on. Measured faster in the engine's 4k, 16k and 32k
# prefills (`python -m bench.micro.engine_steps` against `--no-fused-gate-up`); alone at 1-2k rows
# (`python -m bench.micro.fused_mlp`) it is 4-32% slower.
FUSED_GATE_UP_MIN_ROWS = 4096


@dataclass(frozen=True)
class KernelOptions:
    """Which of our own CUDA kernels replace cuBLAS where they apply; fixed when the model is built.
    The CPU path ignores them."""

    skinny_gemv: bool = True     # decode-sized matmuls (up to 16 rows; 64 where tuned) through the Triton skinny kernel
    fused_gate_up: bool = True   # prefill-sized MLPs on Hopper: gate/up GEMM and SiLU·mul as one Gluon kernel
    pdl: bool = True             # our kernels with programmatic dependent launch on Hopper (engine.kernels.launch)


ALL_KERNELS = KernelOptions()


def apply_launch_options(kernels: KernelOptions) -> None:
    """Launch options that hold for the process (one model in it): programmatic dependent launch."""
    if _launch is not None:
        _launch.set_enabled(kernels.pdl)


def _fast(t: torch.Tensor) -> bool:
    return t.is_cuda and _fused is not None


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + delta) * weight, x + delta); on CUDA x is updated in place."""
    if _fast(x):
        return _fused.add_rms_norm(x, weight, eps, delta)[0], x
    if delta is not None:
        x = x + delta
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x


Linear = nn.Linear | Fp8Linear


@dataclass(frozen=True)
class QuantizedRows:
    """Activations [T, K] with their rows in e4m3 too (and a float32 scale a row, `quantize_rows`'
    bits), written by the kernel that produced them (the norm, the decode attention's merge) for the
    W8A8 projection after it, which would otherwise quantize them in a kernel of its own (`plan`'s
    `takes_e4m3`)."""

    x: torch.Tensor
    e4m3: tuple[torch.Tensor, torch.Tensor]


Activations = torch.Tensor | QuantizedRows


def _unpack(x: Activations) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    return (x.x, x.e4m3) if isinstance(x, QuantizedRows) else (x, None)


class Route(enum.Enum):
    """Which kernel runs a projection (`plan`)."""

    FUSED_GATE_UP = "fused_gate_up"  # 16-bit gate/up with SiLU·mul, prefill-sized: the Gluon GEMM
    VECTOR = "vector"                # e4m3 weights at 1-2 rows: the skinny matmul on CUDA cores
    SKINNY = "skinny"                # up to 64 rows: the skinny matmul's MMA tiles
    SCALED_MM = "scaled_mm"          # e4m3 weights above: torch._scaled_mm, W8A8
    DEQUANTIZED = "dequantized"      # e4m3 weights elsewhere (the CPU): the weight dequantized, then F.linear
    DENSE = "dense"                  # 16-bit weights elsewhere: F.linear


@dataclass(frozen=True)
class Plan:
    """How `linear` (`gate_up_silu` when `gated`) runs a layer on x's rows: the route, its tile, whether
    it takes x's rows quantized to e4m3 by a kernel first (the norm before may write them instead,
    `norm_feeding`), and whether SiLU·mul is in the kernel's epilogue."""

    route: Route
    tile: _gemv.GemvConfig | _gemv_vector.VectorConfig | None = None
    takes_e4m3: bool = False
    silu_inside: bool = False


def plan(x: torch.Tensor, layer: Linear, kernels: KernelOptions, gated: bool = False) -> Plan:
    """The one place that picks a projection's kernel (`linear`, `gate_up_silu` and `norm_feeding` follow it).
    `gated`: the [gate; up] layer with SiLU·mul after, which some routes put in their epilogue; the
    others run as `linear` does and SiLU·mul follows."""
    rows, fast = x.shape[0], _fast(x)
    fp8 = isinstance(layer, Fp8Linear)
    if (gated and kernels.fused_gate_up and not fp8 and _gate_up is not None and fast
            and rows >= FUSED_GATE_UP_MIN_ROWS and _gate_up.supports(x, layer.weight)):
        return Plan(Route.FUSED_GATE_UP, silu_inside=True)
    if kernels.skinny_gemv and fast and not (gated and layer.bias is not None):
        if (vector := _gemv_vector.config_for(x, layer.weight, gated=gated)) is not None:
            return Plan(Route.VECTOR, vector, silu_inside=gated)
        if _gemv.supports(x, layer.weight):
            tile_for = _gemv.gated_config_for if gated else _gemv.config_for
            if (tile := tile_for(layer.weight, rows, _static_x(layer))) is not None:
                # a 64-row W8A8 tile takes x quantized (on the 16-row one each program quantizes its own)
                wide = _gemv.tile_rows(layer.weight, rows) == _gemv.WIDE_ROWS
                return Plan(Route.SKINNY, tile, takes_e4m3=tile.quantize_x and wide,
                            silu_inside=gated)
    if gated:
        return plan(x, layer, kernels)
    if isinstance(layer, Fp8Linear) and scaled_mm_supports(x, layer):
        return Plan(Route.SCALED_MM, takes_e4m3=layer.input_scale is None and fast)
    return Plan(Route.DEQUANTIZED if fp8 else Route.DENSE)


def norm_feeding(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None,
                 layer: Linear, kernels: KernelOptions, gated: bool = False) -> tuple[Activations, torch.Tensor]:
    """`add_rms_norm` before the projection `layer` (gate/up with SiLU·mul when `gated`): where that
    projection would quantize its x first, the norm's kernel writes the e4m3 rows too (one launch a
    projection fewer: batch 64's FP8 step has 56 of them, a prefill's 54)."""
    if not plan(x, layer, kernels, gated).takes_e4m3:
        return add_rms_norm(x, weight, eps, delta)
    out, e4m3 = _fused.add_rms_norm(x, weight, eps, delta, quantize=True, bound=input_bound(layer))
    assert e4m3 is not None
    return QuantizedRows(out, e4m3), x


def input_bound(layer: Linear) -> float | None:
    """The bound on an FP8 layer's dynamic per-token scales (fbgemm_fp8's `activation_scale_ub`), which
    every kernel that quantizes or reads its x applies; None where there is none."""
    return layer.input_bound if isinstance(layer, Fp8Linear) else None


def _static_x(layer: Linear) -> bool:
    """An FP8 layer with a static input scale: `_kernel_operands` gives x quantized already."""
    return isinstance(layer, Fp8Linear) and layer.input_scale is not None


def _kernel_operands(x: torch.Tensor, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, the weight's row scales or None) as the skinny matmul takes them: an FP8 layer's static
    input scale applied to x first."""
    if not isinstance(layer, Fp8Linear):
        return x, None
    if layer.input_scale is None:
        return x, layer.weight_scale
    return fake_quantize(x, layer.input_scale), layer.weight_scale


def linear(x: Activations, layer: Linear, kernels: KernelOptions,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T + b in x's dtype; with `out_dtype` (float32 logits) converted after that rounding,
    by the skinny matmul's store where it runs (no conversion kernel). The kernel is `plan`'s: FP8
    layers run the skinny matmul at decode sizes (on CUDA cores at 1-2 rows, MMA tiles to 64),
    `torch._scaled_mm` (W8A8) above, the dequantized weight elsewhere."""
    x, x_e4m3 = _unpack(x)
    return _run(plan(x, layer, kernels), x, x_e4m3, layer, out_dtype)


def _run(p: Plan, x: torch.Tensor, x_e4m3: tuple[torch.Tensor, torch.Tensor] | None, layer: Linear,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The projection by plan `p`; with `p.silu_inside`, SiLU·mul of the gated layer's two halves."""
    assert x_e4m3 is None or p.takes_e4m3, f"e4m3 rows given to {p.route.value}, which does not take them"
    gated = p.silu_inside
    if p.route is Route.FUSED_GATE_UP:
        return _gate_up.gate_up_silu(x, layer.weight)
    if p.route is Route.VECTOR:
        assert isinstance(p.tile, _gemv_vector.VectorConfig)
        x, scale = _kernel_operands(x, layer)
        assert scale is not None
        return _gemv_vector.gemv_vector(x, layer.weight, scale, p.tile, bias=layer.bias, gated=gated,
                                        out_dtype=out_dtype, x_bound=input_bound(layer))
    if p.route is Route.SKINNY:
        assert isinstance(p.tile, _gemv.GemvConfig)
        x, scale = _kernel_operands(x, layer)  # decode: SiLU·mul in the matmul's epilogue when gated
        bound = input_bound(layer)
        if gated:
            return _gemv.gemv_silu(x, layer.weight, scale=scale, cfg=p.tile, x_e4m3=x_e4m3, x_bound=bound)
        return _gemv.gemv(x, layer.weight, layer.bias, out_dtype=out_dtype, scale=scale, cfg=p.tile, x_e4m3=x_e4m3,
                          x_bound=bound)
    if p.route is Route.SCALED_MM:
        assert isinstance(layer, Fp8Linear)
        out = scaled_matmul(x, layer, x_e4m3)
    elif isinstance(layer, Fp8Linear):
        x, _ = _kernel_operands(x, layer)
        out = F.linear(bound_rows(x, layer.input_bound), layer.dequantized(), layer.bias)
    else:
        out = F.linear(x, layer.weight, layer.bias)
    return out if out_dtype is None else out.to(out_dtype)


def linear_argmax(x: torch.Tensor, layer: Linear, kernels: KernelOptions,
                  tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`linear` to float32 (the lm_head) and each row's argmax ([B] int64, the first among equal
    maxima; written into `tokens` when given), from the skinny matmul's epilogue where its unsplit
    64-row tile runs (batches of 17-64: a decode step 0.05 ms shorter at batch 64, `bench/NOTES.md`)."""
    if (kernels.skinny_gemv and _fast(x) and layer.bias is None
            and _gemv.tile_rows(layer.weight, x.shape[0]) == _gemv.WIDE_ROWS
            and _gemv.supports(x, layer.weight)):  # the 64-row tile; on the 16-row one the argmax kernel is as fast
        cfg = _gemv.config_for(layer.weight, x.shape[0], _static_x(layer))
        if cfg is not None and cfg.split_k == 1:
            x, scale = _kernel_operands(x, layer)
            return _gemv.gemv_argmax(x, layer.weight, out_dtype=torch.float32, cfg=cfg, tokens=tokens, scale=scale,
                                     x_bound=input_bound(layer))
    logits = linear(x, layer, kernels, out_dtype=torch.float32)
    if tokens is None:
        return logits, logits.argmax(dim=-1)
    return logits, torch.argmax(logits, dim=-1, out=tokens)


def gate_up_silu(x: Activations, layer: Linear, kernels: KernelOptions) -> torch.Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) for the fused [gate; up] projection `layer`."""
    x, x_e4m3 = _unpack(x)
    p = plan(x, layer, kernels, gated=True)
    out = _run(p, x, x_e4m3, layer)
    return out if p.silu_inside else silu_mul(out)


def mlp(x: Activations, gate_up: Linear, down: Linear, kernels: KernelOptions) -> torch.Tensor:
    """down(SiLU(x W_gate^T) * (x W_up^T)). An FP8 prefill (both projections on FP8 tensor cores, x
    quantized per token) computes SiLU·mul and the down projection's quantization in one kernel:
    the layer's largest activation is written once, in e4m3, not in 16 bits and then again."""
    rows, x_e4m3 = _unpack(x)
    gate_up_plan = plan(rows, gate_up, kernels, gated=True)
    if (isinstance(down, Fp8Linear) and down.input_scale is None and _fast(rows)
            and gate_up_plan.route is Route.SCALED_MM and scaled_mm_supports(rows, down)):
        xq, x_scale = _fp8_quant.silu_mul_quantize_rows(_run(gate_up_plan, rows, x_e4m3, gate_up), down.input_bound)
        return scaled_matmul_quantized(xq, x_scale, down, rows.dtype)
    return linear(gate_up_silu(x, gate_up, kernels), down, kernels)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _fast(gate_up):
        return _fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., Hkv, L, D] -> [..., Hkv * groups, L, D], each KV head repeated for its query heads, in
    one strided copy (about half the time of repeat_interleave's gather at 32k tokens)."""
    if groups == 1:
        return x
    *lead, hkv, length, dim = x.shape
    return x.unsqueeze(-3).expand(*lead, hkv, groups, length, dim).reshape(*lead, hkv * groups, length, dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_layer: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv [T, (H + 2 Hkv) D], rotate q and k, write k and v into the pool layer at `slots`.
    Returns q [T, H, D], k and v [T, Hkv, D]; with `rows` (>= T), [rows, ...] with zeros past T
    (what padded whole-prompt attention reads)."""
    if _fast(qkv):
        return _fused.rope_and_store(qkv, positions, cos, sin, kv_layer, slots, num_heads, num_kv_heads, head_dim,
                                     rows)
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim)
    c = cos[positions].to(q.dtype).unsqueeze(1)
    s = sin[positions].to(q.dtype).unsqueeze(1)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    as_bytes(kv_layer).index_copy_(1, slots, as_bytes(to_kv_dtype(torch.stack((k, v)), kv_layer.dtype)))
    if rows is not None and rows > t:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, rows - t)) for x in (q, k, v))
    return q, k, v


def embed(ids: torch.Tensor, weight: torch.Tensor,
          feed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The embedding rows of `ids` [B]. With `feed` (sources, previous), a row whose source is >= 0
    takes its token from previous[source] instead: the last step's tokens, still on the device (a
    step queued before they were read back). On CUDA the feed and the gather are one launch."""
    if feed is None:
        return F.embedding(ids, weight)
    sources, previous = feed
    if _fast(ids):
        return _fused.embed_fed(ids, sources, previous, weight)
    fed = previous[sources.clamp(min=0)].to(ids.dtype)
    return F.embedding(torch.where(sources >= 0, fed, ids), weight)
