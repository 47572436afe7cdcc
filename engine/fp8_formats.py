"""The FP8 checkpoint formats read: a checkpoint's quantization config as one `Fp8Format`, or a
one-line refusal naming what it is.

- compressed-tensors (llm-compressor), `format: float-quantized`, one config group on `Linear`:
  weight strategy `channel` (`weight_scale` [N, 1]; FP8_DYNAMIC), `tensor` (`weight_scale` [1] with a
  static per-tensor `input_scale`; FP8) or `block` (`weight_scale` [ceil(N/b0), ceil(K/b1)];
  FP8_BLOCK); `ignore` names modules (or `re:` patterns) kept unquantized; a `kv_cache_scheme`'s
  per-layer `k_scale` / `v_scale` are folded into the weights (`loader.fold_kv_scales`); with no config
  group that targets anything, the checkpoint quantizes only its KV cache and its weights are 16-bit.
- transformers' `fp8` (Qwen3-*-FP8, DeepSeek): `weight_block_size` [b0, b1] blocks with fp32
  `weight_scale_inv` [ceil(N/b0), ceil(K/b1)] (a multiplier, despite the name), dynamic activations;
  `modules_to_not_convert` kept unquantized. Without blocks, AutoFP8's `fp8` (the 2024 `*-FP8`
  checkpoints of Llama 3 and others): a per-tensor `weight_scale`, `activation_scheme` `static` (an
  `input_scale` a module) or `dynamic`, `ignored_layers`, and with `kv_cache_scheme: static` each
  layer's `self_attn.k_scale` / `v_scale` (older exports: `k_proj.output_scale` / `v_proj.output_scale`).
  KV-only configs (compressed-tensors' or ModelOpt's KV scheme with no weight quantization) keep the
  weights in 16 bits and fold the KV scales into them.
- NVIDIA ModelOpt (the `nvidia/*-FP8` checkpoints), from config.json's `quantization_config`
  (`quant_method: modelopt`) or, in older exports, `hf_quant_config.json` beside it: `quant_algo`
  `FP8` (per-tensor `weight_scale` and static `input_scale`), `FP8_PER_CHANNEL_PER_TOKEN` (`weight_scale`
  [N], dynamic activations) or `FP8_PB_WO` (128 x 128 blocks, `weight_scale` [N/128, 1, K/128, 1]);
  `exclude_modules` (or `ignore`) are wildcard patterns; an FP8 `kv_cache_quant_algo` (or
  `kv_cache_scheme`) comes with `self_attn.k_proj.k_scale` / `v_proj.v_scale` a layer; without a
  `quant_algo`, only the KV cache is quantized.
- FBGEMM's `fbgemm_fp8` (Meta's `Llama-3.1-*-FP8`): `weight_scale` [N, 1] a channel, activations
  quantized per token with each row's scale bounded by `activation_scale_ub` (so a row's magnitudes
  past the bound saturate: the layer sees its input clamped to +-bound), `modules_to_not_convert`
  read as transformers reads it, and the output embeddings kept unquantized. Older transformers saved
  the bound as each module's `input_scale_ub` too; it must be the config's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

SUPPORTED = ("compressed-tensors FP8 (FP8_DYNAMIC, FP8, FP8_BLOCK), fp8 (transformers' blocks or AutoFP8's "
             "per-tensor scales), modelopt (FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO) and fbgemm_fp8")
MODELOPT_FILE = "hf_quant_config.json"  # where ModelOpt exports before config.json's quantization_config kept it
MODELOPT_BLOCK = (128, 128)  # FP8_PB_WO's block, which its config does not state
FBGEMM_BOUND = 1200.0  # `activation_scale_ub` where an fbgemm_fp8 config leaves it out: transformers' default


class UnsupportedQuantization(ValueError):
    """The quantization_config is not one this engine runs; the message names it."""


@dataclass(frozen=True)
class Fp8Format:
    method: str                        # "compressed-tensors", "fp8", "modelopt" or "fbgemm_fp8"
    weight: str                        # "channel", "tensor", "block" (the scale granularity) or "none" (KV only)
    block: tuple[int, int] | None      # rows, columns of a block
    static_input: bool                 # a per-tensor `input_scale` quantizes each layer's activations
    ignore: tuple[str, ...] = ()       # modules kept unquantized: names, or "re:" + a pattern
    scale_name: str = "weight_scale"   # the scale tensor's suffix: weight_scale or weight_scale_inv
    kv_scales: bool = False            # a k and v scale a layer (names: `loader._KV_SCALE`)
    input_bound: float | None = None   # dynamic activations: a row's scale at most this / 448 (fbgemm_fp8)

    def quantizes(self, module: str) -> bool:
        """Whether the transformers module `module` (e.g. model.layers.0.mlp.down_proj) is FP8. An ignore
        entry means what the tool that wrote it means: compressed-tensors' is a module's name or, after
        "re:", a pattern matched from the name's start; transformers' `modules_to_not_convert` entry (in
        `fp8` and `fbgemm_fp8`) is a pattern matched from the start to a module boundary ("model.layers.1"
        takes model.layers.1.mlp.up_proj, not model.layers.11's), or the end of the name ("down_proj");
        ModelOpt's is a wildcard pattern over the whole name, where a trailing `*` straight after a name
        ("model.layers.1*") is how it writes a module and everything under it (not model.layers.11).
        A KV-only config quantizes no module."""
        if self.weight == "none":
            return False
        if self.method == "modelopt":
            return not any(fnmatchcase(module, entry[:-1]) or fnmatchcase(module, entry[:-1] + ".*")
                           if entry.endswith("*") and not entry.endswith(".*") else fnmatchcase(module, entry)
                           for entry in self.ignore)
        if self.method in ("fp8", "fbgemm_fp8"):
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
    if method == "modelopt":
        return _modelopt(config)
    if method == "fbgemm_fp8":
        return _fbgemm(config)
    raise UnsupportedQuantization(f"quantization_config quant_method {method!r} is not supported (supported: "
                                  f"{SUPPORTED})")


def _refuse(method: str, what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config quant_method {method!r} with {what} is not supported "
                                   f"(supported: {SUPPORTED})")


def _hf_fp8(config: dict[str, Any]) -> Fp8Format:
    """transformers' block FP8 (`weight_block_size`), or without blocks AutoFP8's (vLLM's `fp8`): one
    `weight_scale` a module, activations quantized per token or, `activation_scheme: static`, by each
    module's `input_scale`, and with `kv_cache_scheme: static` a k and v scale a layer."""
    method = "fp8"
    if config.get("fmt", "e4m3") != "e4m3":
        raise _refuse(method, f"fmt {config.get('fmt')!r}")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(method, f"activation_scheme {scheme!r}")
    ignore = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
    if not isinstance(ignore, list):
        raise _refuse(method, f"ignored_layers {ignore!r} (a list is needed)")
    kv = config.get("kv_cache_scheme")
    block = config.get("weight_block_size")
    if block is None:
        if kv not in (None, "static"):
            raise _refuse(method, f"kv_cache_scheme {kv!r}")
        return Fp8Format(method, "tensor", None, scheme == "static", tuple(ignore), kv_scales=kv == "static")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(method, f"weight_block_size {block!r} (a [rows, columns] block is needed)")
    if scheme != "dynamic" or kv is not None:
        raise _refuse(method, f"activation_scheme {scheme!r} and kv_cache_scheme {kv!r} with weight_block_size "
                      f"{block} (blocks take dynamic activations and no KV scales)")
    # transformers never converts the output embeddings (its FP8 checkpoints keep lm_head in bf16)
    return Fp8Format(method, "block", (block[0], block[1]), False, ("lm_head", *ignore), "weight_scale_inv")


def _compressed_tensors(config: dict[str, Any]) -> Fp8Format:
    method = "compressed-tensors"
    groups = config.get("config_groups")
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
    if kv and (not isinstance(kv, dict) or (kv.get("type"), kv.get("num_bits"), kv.get("strategy"),
                                            kv.get("dynamic", False)) != ("float", 8, "tensor", False)):
        shown = f"{kv.get('type')} {kv.get('num_bits')}-bit {kv.get('strategy')}" if isinstance(kv, dict) else kv
        raise _refuse(method, f"a kv_cache_scheme of {shown} scales")
    targeted = [g for g in (groups.values() if isinstance(groups, dict) else ()) if isinstance(g, dict)
                and g.get("targets")]
    if kv and (groups is None or isinstance(groups, dict)) and not targeted:  # llm-compressor's KV-only recipe
        return Fp8Format(method, "none", None, False, kv_scales=True)
    if config.get("format") != "float-quantized" or not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(method, f"format {config.get('format')!r} and {len(groups or {})} config groups (one "
                      "float-quantized group is supported)")
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


def _modelopt(config: dict[str, Any]) -> Fp8Format:
    """config.json's form (`quant_algo`, `ignore`, `kv_cache_scheme`) or `hf_quant_config.json`'s
    (`quantization`: `quant_algo`, `exclude_modules`, `kv_cache_quant_algo`)."""
    method = "modelopt"
    legacy = config.get("quantization")
    if legacy is not None and not isinstance(legacy, dict):
        raise _refuse(method, f"quantization {legacy!r} (an object is needed)")
    fields = legacy if legacy is not None else config
    algo = str(fields.get("quant_algo") or "").upper()
    ignore = fields.get("exclude_modules" if legacy is not None else "ignore") or []
    if not isinstance(ignore, list):
        raise _refuse(method, f"exclude_modules {ignore!r} (a list is needed)")
    if legacy is not None:
        kv_algo = fields.get("kv_cache_quant_algo")
        kv = kv_algo is not None
        if kv and str(kv_algo).upper() != "FP8":
            raise _refuse(method, f"kv_cache_quant_algo {kv_algo!r}")
    else:
        scheme = config.get("kv_cache_scheme")
        kv = scheme is not None
        if kv and not (isinstance(scheme, dict) and (scheme.get("type"), scheme.get("num_bits")) == ("float", 8)
                       and not scheme.get("dynamic", False)):
            raise _refuse(method, f"kv_cache_scheme {scheme!r}")
    if not algo and kv:  # the KV cache alone quantized
        return Fp8Format(method, "none", None, False, kv_scales=True)
    if algo == "FP8":
        return Fp8Format(method, "tensor", None, True, tuple(ignore), kv_scales=kv)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Fp8Format(method, "channel", None, False, tuple(ignore), kv_scales=kv)
    if algo == "FP8_PB_WO":
        return Fp8Format(method, "block", MODELOPT_BLOCK, False, tuple(ignore), kv_scales=kv)
    raise _refuse(method, f"quant_algo {fields.get('quant_algo')!r}")


def _fbgemm(config: dict[str, Any]) -> Fp8Format:
    """FBGEMM's row-wise FP8: per-channel weight scales, per-token activations whose scales are
    bounded by `activation_scale_ub` (transformers' default where the config leaves it out)."""
    method = "fbgemm_fp8"
    bound = config.get("activation_scale_ub", FBGEMM_BOUND)
    if isinstance(bound, bool) or not isinstance(bound, int | float) or not 0 < bound < float("inf"):
        raise _refuse(method, f"activation_scale_ub {bound!r} (a positive number is needed)")
    ignore = config.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise _refuse(method, f"modules_to_not_convert {ignore!r} (a list of module names is needed)")
    # as in transformers' `fp8`, the output embeddings are never converted
    return Fp8Format(method, "channel", None, False, ("lm_head", *ignore), input_bound=float(bound))


def scale_shapes(fmt: Fp8Format, n: int, k: int) -> list[tuple[int, ...]]:
    """The shapes a checkpoint stores an [n, k] weight's scale in; the first is the one `dequantize`
    reads, and any other reshapes to it."""
    if fmt.weight == "block":
        assert fmt.block is not None
        rows, cols = -(-n // fmt.block[0]), -(-k // fmt.block[1])
        return [(rows, cols)] + ([(rows, 1, cols, 1)] if fmt.method == "modelopt" else [])
    return [(n, 1), (n,)] if fmt.weight == "channel" else [(1,), ()]

