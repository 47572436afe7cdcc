"""FP8 (e4m3) weights: one layout in memory, the checkpoints' values in it, quantization at load.
The formats read, and their scales' shapes, are `engine.fp8_formats`'.

In memory an FP8 layer is an `Fp8Linear`: e4m3 rows with one float32 scale per output channel,
which the skinny decode matmul and `torch._scaled_mm` read. A per-tensor scale is that scale on
every row (exact). Block scales are folded into the values and requantized with one scale a row
(`to_per_channel`): a value then rounds once more in e4m3, an error of at most half an e4m3 step
(2^-4 relative) beside the checkpoint's own rounding, and values below the row's e4m3 range lose
more (tested bound in tests/test_fp8_loading.py). On the CPU (the reference path) weights are
dequantized to the compute dtype at load and run through the plain matmul.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.fp8_formats import Fp8Format

try:
    from engine.kernels.fp8_quant import quantize_rows as _quantize_rows
except ImportError:  # no Triton: CPU-only installs, where the reference path runs
    _quantize_rows = None  # type: ignore[assignment]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448

# e4m3 in our Triton kernels (Triton has no e4m3 type below it) and in cuBLASLt's FP8 GEMMs: Ada, Hopper and newer
FP8_CAPABILITY = (8, 9)


def device_problem(device: torch.device) -> str | None:
    """Why `device` can't hold e4m3 weights or KV, or None where it can (the CPU: the reference path)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= FP8_CAPABILITY:
        return None
    return (f"{device} ({torch.cuda.get_device_name(device)}) is compute capability {capability[0]}.{capability[1]}, "
            f"and FP8 (e4m3) runs on {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (Ada, Hopper)")


def dtype_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why FP8 weights can't run with `dtype` activations on `device`, or None: on a GPU the FP8 kernels
    multiply 16-bit activations, and float32 ones would take each weight dequantized at every step."""
    if device.type != "cuda" or dtype != torch.float32:
        return None
    return ("--dtype float32 on a GPU would dequantize every FP8 weight at every step; use --dtype bfloat16 (or "
            "auto), whose activations the FP8 kernels multiply")


def weights_refusal(what: str, device: torch.device, dtype: torch.dtype, advice: str) -> str | None:
    """The one line refusing FP8 weights (`what`: where they come from) that `device` or `dtype` can't run,
    with `advice` where the GPU lacks e4m3; None where they run."""
    if problem := device_problem(device):
        return f"{what}, but {problem}; {advice}"
    if problem := dtype_problem(device, dtype):
        return f"{what}: {problem}"
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The checkpoint's float32 values: e4m3 times its scale (a row's, the tensor's or a block's)."""
    w = weight.float()
    if fmt.weight == "block":
        assert fmt.block is not None
        rows, cols = fmt.block
        expanded = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return w * expanded[:w.shape[0], :w.shape[1]]
    return w * scale.float().reshape(-1, 1)  # [N, 1] per channel, [1] or [] per tensor


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales [N]): each row scaled so its largest magnitude is e4m3's largest."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def to_per_channel(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-memory layout: (e4m3 [N, K], float32 scales [N]). Exact for channel and tensor scales;
    block scales are folded in and each row requantized (see the module's note)."""
    if fmt.weight == "block":
        return quantize_per_channel(dequantize(weight, scale, fmt))
    return weight.contiguous(), scale.float().reshape(-1).expand(weight.shape[0]).contiguous()


def bound_rows(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    """x clamped to +-`bound`: what a per-token scale bounded by `bound` / 448 does to a row, less the
    e4m3 rounding (magnitudes past the bound saturate at e4m3's largest times that scale). The reference
    path's, where dynamic activations are not rounded to e4m3."""
    return x if bound is None else x.clamp(-bound, bound)


def fake_quantize(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Activations as a static per-tensor `input_scale` quantizes them: e4m3 of x / scale, times scale."""
    return ((x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * input_scale).to(x.dtype)


class Fp8Linear(nn.Module):
    """A linear layer whose checkpoint weights are FP8. With `keep_fp8` (CUDA) `weight` is e4m3 with
    `weight_scale` [N] per output channel; without (the CPU reference path) `weight` holds the
    dequantized values in the compute dtype and `weight_scale` is None. `input_scale`, where the
    checkpoint quantizes activations statically, and `input_bound`, where it bounds the dynamic
    per-token scales (fbgemm_fp8), are applied on every path."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 keep_fp8: bool, static_input: bool, input_bound: float | None = None) -> None:
        super().__init__()
        assert not (static_input and input_bound is not None), "a bound is for dynamic scales"
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
        self.input_bound = input_bound
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8 if keep_fp8 else dtype,
                                               device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.weight_scale: torch.Tensor | None
        self.input_scale: torch.Tensor | None
        self.register_buffer("weight_scale", torch.ones(out_features, device=device) if keep_fp8 else None)
        self.register_buffer("input_scale", torch.zeros((), device=device) if static_input else None)

    def set_rows(self, rows: slice, values: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Fill output rows from one checkpoint module: e4m3 values with their scales [rows] (kept FP8),
        or float values (the reference path)."""
        if self.weight_scale is not None:
            assert values.dtype == FP8 and scale is not None
            self.weight.data[rows] = values.to(self.weight.device)
            self.weight_scale[rows] = scale.to(self.weight_scale.device)
        else:
            self.weight.data[rows] = values.to(self.weight.dtype) if scale is None else \
                (values.float() * scale.float()[:, None]).to(self.weight.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight in the compute dtype."""
        if self.weight_scale is None:
            return self.weight
        return (self.weight.float() * self.weight_scale[:, None]).to(self.compute_dtype)


def replace_linears(model: nn.Module, names: Iterable[str], keep_fp8: bool, static_input: bool,
                    input_bound: float | None = None) -> None:
    """Swap each named nn.Linear of `model` (e.g. layers.0.qkv) for an empty `Fp8Linear` of its shape."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        assert isinstance(old, nn.Linear), name
        setattr(parent, attr, Fp8Linear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype,
                                        old.weight.device, keep_fp8, static_input, input_bound))


def quantize_model(model: nn.Module, layer_names: Iterable[str], keep_fp8: bool) -> None:
    """`--quantization fp8`: each named nn.Linear quantized per output channel in place (its bias kept).
    On the reference path the e4m3 values are dequantized again, so tokens show the rounding."""
    for name in layer_names:
        old = model.get_submodule(name)
        assert isinstance(old, nn.Linear), name
        values, scale = quantize_per_channel(old.weight.data)
        replace_linears(model, [name], keep_fp8, False)
        new = model.get_submodule(name)
        assert isinstance(new, Fp8Linear)
        new.set_rows(slice(None), values, scale)
        if old.bias is not None and new.bias is not None:
            new.bias.data.copy_(old.bias.data)


def scaled_mm_supports(x: torch.Tensor, layer: Fp8Linear) -> bool:
    """Whether `scaled_matmul` runs: e4m3 tensor cores (compute capability 8.9+), bf16 activations,
    and the 16-element alignment cuBLASLt's FP8 path needs."""
    return (x.is_cuda and layer.weight_scale is not None and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and layer.in_features % 16 == 0 and layer.out_features % 16 == 0)


def scaled_matmul(x: torch.Tensor, layer: Fp8Linear,
                  x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, K] bf16 @ the layer's e4m3 weight on FP8 tensor cores (`torch._scaled_mm`, row-wise
    scales): activations quantized per token (largest magnitude to e4m3's largest, or to the layer's
    `input_bound`; `x_e4m3` when the norm before wrote them), or with the checkpoint's static
    `input_scale`; float32 accumulation with the bias, then bf16."""
    assert layer.weight_scale is not None
    if x_e4m3 is not None:
        assert layer.input_scale is None, "a static input scale quantizes x itself"
        xq, x_scale = x_e4m3
    elif layer.input_scale is None and _quantize_rows is not None and x.stride(1) == 1:
        xq, x_scale = _quantize_rows(x, layer.input_bound)  # one kernel
    else:
        if layer.input_scale is None:
            amax = x.abs().amax(dim=1, keepdim=True).float()
            if layer.input_bound is not None:
                amax = amax.clamp(max=layer.input_bound)
            x_scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        else:
            x_scale = layer.input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return scaled_matmul_quantized(xq, x_scale, layer, x.dtype)


def scaled_matmul_quantized(xq: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """`scaled_matmul` of x quantized already: e4m3 [T, K] with float32 scales [T, 1]. The bias is
    added in the GEMM's epilogue, to the float32 sums before the rounding (as the skinny matmul adds
    it): a separate add was a pass over the output, 0.44 ms a layer for qkv at 32k tokens."""
    assert layer.weight_scale is not None
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale.reshape(1, -1),
                            bias=layer.bias, out_dtype=out_dtype)


def scale_rows(layer: nn.Linear | Fp8Linear, rows: slice, factor: float) -> None:
    """Output rows of a linear layer (16-bit or FP8) multiplied by `factor`, its bias too."""
    if isinstance(layer, Fp8Linear) and layer.weight_scale is not None:
        layer.weight_scale[rows] *= factor  # exact: the e4m3 values stay as they are
    else:
        layer.weight.data[rows] *= factor
    if layer.bias is not None:
        layer.bias.data[rows] *= factor

