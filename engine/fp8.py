"""FP8 (e4m3) weights: the checkpoint formats read, one layout in memory, quantization at load.

Formats read (config.json's `quantization_config`):
- compressed-tensors (llm-compressor), `format: float-quantized`, one config group on `Linear`:
  weight strategy `channel` (`weight_scale` [N, 1]; FP8_DYNAMIC), `tensor` (`weight_scale` [1] with a
  static per-tensor `input_scale`; FP8) or `block` (`weight_scale` [ceil(N/b0), ceil(K/b1)];
  FP8_BLOCK); `ignore` names modules (or `re:` patterns) kept unquantized; a `kv_cache_scheme`'s
  per-layer `k_scale` / `v_scale` are folded into the weights (`loader.fold_kv_scales`).
- transformers' `fp8` (Qwen3-*-FP8, DeepSeek): `weight_block_size` [b0, b1] blocks with fp32
  `weight_scale_inv` [ceil(N/b0), ceil(K/b1)] (a multiplier, despite the name), dynamic activations;
  `modules_to_not_convert` kept unquantized.

In memory an FP8 layer is an `Fp8Linear`: e4m3 rows with one float32 scale per output channel,
which the skinny decode matmul and `torch._scaled_mm` read. A per-tensor scale is that scale on
every row (exact). Block scales are folded into the values and requantized with one scale a row
(`to_per_channel`): a value then rounds once more in e4m3, an error of at most half an e4m3 step
(2^-4 relative) beside the checkpoint's own rounding, and values below the row's e4m3 range lose
more (tested bound in tests/test_fp8_loading.py). On the CPU (the reference path) weights are
dequantized to the compute dtype at load and run through the plain matmul.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    from engine.kernels.fp8_quant import quantize_rows as _quantize_rows
except ImportError:  # no Triton: CPU-only installs, where the reference path runs
    _quantize_rows = None  # type: ignore[assignment]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448

SUPPORTED = ("compressed-tensors FP8 (FP8_DYNAMIC, FP8, FP8_BLOCK) and fp8 (block)")
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


class UnsupportedQuantization(ValueError):
    """The quantization_config is not one this engine runs; the message names it."""


@dataclass(frozen=True)
class Fp8Format:
    method: str                        # "compressed-tensors" or "fp8"
    weight: str                        # "channel", "tensor" or "block": the checkpoint's scale granularity
    block: tuple[int, int] | None      # rows, columns of a block
    static_input: bool                 # a per-tensor `input_scale` quantizes each layer's activations
    ignore: tuple[str, ...] = ()       # modules kept unquantized: names, or "re:" + a pattern
    scale_name: str = "weight_scale"   # the scale tensor's suffix: weight_scale or weight_scale_inv
    kv_scales: bool = False            # per-layer `self_attn.k_scale` / `v_scale` (a kv_cache_scheme)

    def quantizes(self, module: str) -> bool:
        """Whether the transformers module `module` (e.g. model.layers.0.mlp.down_proj) is FP8. An ignore
        entry means what the tool that wrote it means: compressed-tensors' is a module's name or, after
        "re:", a pattern matched from the name's start; transformers' `modules_to_not_convert` entry is
        a pattern matched from the start to a module boundary ("model.layers.1" takes
        model.layers.1.mlp.up_proj, not model.layers.11's), or the end of the name ("down_proj")."""
        if self.method == "fp8":
            return not any(re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(entry)
                           for entry in self.ignore)
        for entry in self.ignore:
            if entry.startswith("re:") and re.match(entry[3:], module) or module == entry:
                return False
        return True


def read_format(config: object) -> Fp8Format:
    """A quantization_config as an `Fp8Format`, or `UnsupportedQuantization` naming what it is."""
    if not isinstance(config, dict):
        raise UnsupportedQuantization(f"quantization_config {config!r} is not an object")
    method = config.get("quant_method")
    if method == "fp8":
        return _hf_fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise UnsupportedQuantization(f"quantization_config quant_method {method!r} is not supported (supported: "
                                  f"{SUPPORTED})")


def _refuse(method: str, what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config quant_method {method!r} with {what} is not supported "
                                   f"(supported: {SUPPORTED})")


def _hf_fp8(config: dict[str, Any]) -> Fp8Format:
    if config.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fp8", f"fmt {config.get('fmt')!r}")
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("fp8", f"activation_scheme {config.get('activation_scheme')!r}")
    block = config.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("fp8", f"weight_block_size {block!r} (a [rows, columns] block is needed)")
    ignore = config.get("modules_to_not_convert") or []
    assert isinstance(ignore, list)
    # transformers never converts the output embeddings (its FP8 checkpoints keep lm_head in bf16)
    return Fp8Format("fp8", "block", (block[0], block[1]), False, ("lm_head", *ignore), "weight_scale_inv")


def _compressed_tensors(config: dict[str, Any]) -> Fp8Format:
    method = "compressed-tensors"
    groups = config.get("config_groups")
    if config.get("format") != "float-quantized" or not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(method, f"format {config.get('format')!r} and {len(groups or {})} config groups (one "
                      "float-quantized group is supported)")
    # 2:4 or bitmask-compressed weights are stored as other tensors than a dense `weight`; transforms
    # (rotations such as SpinQuant's or QuIP's) are applied to activations at run time: neither runs here
    sparsity = config.get("sparsity_config") or {}
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        shown = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        raise _refuse(method, f"sparse weights (sparsity_config format {shown!r})")
    transforms = config.get("transform_config") or {}
    if transforms and (not isinstance(transforms, dict) or transforms.get("config_groups", transforms)):
        raise _refuse(method, "a transform_config (rotations applied to activations at run time)")
    kv = config.get("kv_cache_scheme")
    if kv and ((kv.get("type"), kv.get("num_bits"), kv.get("strategy"), kv.get("dynamic", False))
               != ("float", 8, "tensor", False)):
        raise _refuse(method, f"a kv_cache_scheme of {kv.get('type')} {kv.get('num_bits')}-bit "
                      f"{kv.get('strategy')} scales")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("format", "float-quantized") != "float-quantized":
        raise _refuse(method, f"a config group in format {group.get('format')!r}")
    if group.get("targets") != ["Linear"] or group.get("output_activations"):
        raise _refuse(method, f"targets {group.get('targets')!r} or output activations")
    if (weights.get("type"), weights.get("num_bits"), weights.get("symmetric", True),
            weights.get("dynamic", False)) != ("float", 8, True, False):
        raise _refuse(method, f"{weights.get('type')} {weights.get('num_bits')}-bit weights")
    strategy = weights.get("strategy")
    block = weights.get("block_structure")
    if strategy == "block":
        if not (isinstance(block, list) and len(block) == 2):
            raise _refuse(method, f"block_structure {block!r}")
        block = (int(block[0]), int(block[1]))
    elif strategy not in ("channel", "tensor"):
        raise _refuse(method, f"weight strategy {strategy!r}")
    static = False
    if inputs:
        if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
            raise _refuse(method, f"{inputs.get('type')} {inputs.get('num_bits')}-bit activations")
        static = not inputs.get("dynamic", False)
        if static and inputs.get("strategy") != "tensor":
            raise _refuse(method, f"static {inputs.get('strategy')!r} activation scales")
    ignore = config.get("ignore") or []
    assert isinstance(ignore, list)
    return Fp8Format(method, str(strategy), block if strategy == "block" else None, static, tuple(ignore),
                     kv_scales=bool(kv))


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


def fake_quantize(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Activations as a static per-tensor `input_scale` quantizes them: e4m3 of x / scale, times scale."""
    return ((x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * input_scale).to(x.dtype)


class Fp8Linear(nn.Module):
    """A linear layer whose checkpoint weights are FP8. With `keep_fp8` (CUDA) `weight` is e4m3 with
    `weight_scale` [N] per output channel; without (the CPU reference path) `weight` holds the
    dequantized values in the compute dtype and `weight_scale` is None. `input_scale`, where the
    checkpoint quantizes activations statically, is applied on every path."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device,
                 keep_fp8: bool, static_input: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
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


def replace_linears(model: nn.Module, names: Iterable[str], keep_fp8: bool, static_input: bool) -> None:
    """Swap each named nn.Linear of `model` (e.g. layers.0.qkv) for an empty `Fp8Linear` of its shape."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        assert isinstance(old, nn.Linear), name
        setattr(parent, attr, Fp8Linear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype,
                                        old.weight.device, keep_fp8, static_input))


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
    scales): activations quantized per token (largest magnitude to e4m3's largest; `x_e4m3` when the
    norm before wrote them), or with the checkpoint's static `input_scale`; float32 accumulation
    with the bias, then bf16."""
    assert layer.weight_scale is not None
    if x_e4m3 is not None:
        assert layer.input_scale is None, "a static input scale quantizes x itself"
        xq, x_scale = x_e4m3
    elif layer.input_scale is None and _quantize_rows is not None and x.stride(1) == 1:
        xq, x_scale = _quantize_rows(x)  # one kernel
    else:
        if layer.input_scale is None:
            x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
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

