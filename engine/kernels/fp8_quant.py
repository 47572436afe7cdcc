"""Per-token FP8 quantization of activations for `torch._scaled_mm` and the skinny matmul's W8A8
tiles: each row scaled so its largest magnitude (or the layer's bound, where that is smaller) is
e4m3's largest, in one kernel that reads x once
(a row of up to 32k columns held in registers) and writes the e4m3 rows and a float32 scale a
row. The same in PyTorch ops is about six passes over a float32 copy: at a 32k-token prefill's
MLP input, milliseconds a layer.
`silu_mul_quantize_rows` does the same for the down projection's input straight from the gate/up
projection's output, so SiLU·mul's 16-bit result is never written and read back."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import launch
from engine.kernels.fused import e4m3_scale, silu_mul_rounded, store_e4m3_row, to_e4m3_range

BLOCK = 1024  # a loop step over rows longer than MAX_WHOLE_ROW
MAX_WHOLE_ROW = 32768  # up to this many columns a row is held whole, 32 values a thread (32 warps at most)


@triton.jit
def _quantize_rows_kernel(X, Q, SCALE, K, s_x, s_q, BOUND: tl.constexpr, BLOCK: tl.constexpr,
                          WHOLE_ROW: tl.constexpr, PDL: tl.constexpr):
    """A row a program. WHOLE_ROW: the row is read once into registers (BLOCK covers it); else two
    passes of BLOCK steps, the second meant to come from L2."""
    if PDL:  # the kernel before has finished (engine.kernels.launch)
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if WHOLE_ROW:
        mask = offs < K
        x = tl.load(X + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
        store_e4m3_row(x, Q + row * s_q + offs, SCALE + row, mask, BOUND)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(X + row * s_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = e4m3_scale(tl.max(amax, axis=0), BOUND)
        tl.store(SCALE + row, scale)
        for k0 in range(0, K, BLOCK):
            mask = k0 + offs < K
            x = tl.load(X + row * s_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(Q + row * s_q + k0 + offs, to_e4m3_range(x, scale).to(Q.dtype.element_ty), mask=mask)


def quantize_rows(x: torch.Tensor, bound: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit, rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]), x ~ e4m3 * scale;
    with `bound`, no scale is above bound / 448 (x clamped to +-bound, then quantized)."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        whole = k <= MAX_WHOLE_ROW
        block = triton.next_power_of_2(k) if whole else BLOCK
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BOUND=bound or 0.0, BLOCK=block,
                                    WHOLE_ROW=whole, num_warps=_whole_row_warps(block), **launch.options())
    return q, scale


def _whole_row_warps(block: int) -> int:
    """32 values a thread, 4 to 32 warps."""
    return max(4, min(32, block // 1024))


# `silu_mul_quantize_rows`: columns a step of its passes over a row, warps, programs an SM (each on one row at a
# time). From `python -m bench.micro.quantize_rows --silu` (bench/results/silu-mul-quantize-h200.json): at 32k
# rows of 18,944, 1,343 us against the whole-row kernel's 1,374 (each timed alone, in one call); 4 warps took
# 1,604-2,456 us.
SILU_BLOCK = 2048
SILU_WARPS = 8
SILU_PROGRAMS_PER_SM = 6


@triton.jit
def _silu_mul_quantize_kernel(GU, Q, SCALE, M, INTER, s_q, BOUND: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
    """Persistent: each program takes rows M apart by the grid. A row in two passes of BLOCK steps,
    SiLU(gate) * up as `fused.silu_mul` computes it both times: its largest magnitude, then the e4m3
    values; the second pass is meant to find the row in L2. A row held whole in registers instead
    took the register file, one row an SM at a time; both read about half of HBM bandwidth, this
    one a little faster (bench/NOTES.md)."""
    if PDL:  # the kernel before has finished (engine.kernels.launch)
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    for row in range(tl.program_id(0).to(tl.int64), M, tl.num_programs(0)):
        gu = GU + row * 2 * INTER
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul_step(gu, k0, offs, INTER)))
        scale = e4m3_scale(tl.max(amax, axis=0), BOUND)
        tl.store(SCALE + row, scale)
        q = Q + row * s_q
        for k0 in range(0, INTER, BLOCK):
            h = _silu_mul_step(gu, k0, offs, INTER)
            tl.store(q + k0 + offs, to_e4m3_range(h, scale).to(Q.dtype.element_ty), mask=k0 + offs < INTER)


@triton.jit
def _silu_mul_step(gu, k0, offs, INTER):
    """SiLU(gate) * up at a row's columns k0 + `offs` (gate and up INTER apart from `gu`), rounded as
    `fused.silu_mul` rounds it, in float32; columns past INTER are zero."""
    mask = k0 + offs < INTER
    h = silu_mul_rounded(tl.load(gu + k0 + offs, mask=mask, other=0.0),
                         tl.load(gu + INTER + k0 + offs, mask=mask, other=0.0))
    return h.to(tl.float32)


def silu_mul_quantize_rows(gate_up: torch.Tensor, bound: float | None = None, block: int = SILU_BLOCK,
                           programs: int | None = None,
                           num_warps: int = SILU_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] = [gate | up] (16-bit, contiguous) -> `quantize_rows(silu_mul(gate_up), bound)`,
    the same bits, in one kernel: SiLU·mul's 16-bit result is never written. `programs`: the grid (by
    default SILU_PROGRAMS_PER_SM an SM); `block`, `num_warps`: a step's columns and the warps (for
    `bench.micro.quantize_rows --silu`)."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty(m, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=gate_up.device)
    if m:
        if programs is None:
            programs = SILU_PROGRAMS_PER_SM * _sm_count(gate_up.device)
        _silu_mul_quantize_kernel[(min(m, programs),)](gate_up, q, scale, m, inter, q.stride(0),
                                                        BOUND=bound or 0.0, BLOCK=block, num_warps=num_warps,
                                                        **launch.options())
    return q, scale


def _sm_count(device: torch.device) -> int:
    """The GPU's SMs; the interpreter's CPU counts as 1."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
