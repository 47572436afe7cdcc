"""Build the model on a device: from a local Hugging Face checkpoint folder, or a built-in preset."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.byte_tokenizer import byte_tokenizer
from engine.checkpoint_names import LINEARS, is_harmless, linear_parts, unused_weight_message, weight_map
from engine.device import dtype_name, free_memory
from engine.fp8 import (
    FP8,
    Fp8Linear,
    dequantize,
    quantize_model,
    replace_linears,
    scale_rows,
    to_per_channel,
    weights_refusal,
)
from engine.fp8_formats import MODELOPT_FILE, Fp8Format, UnsupportedQuantization, read_format, scale_shapes
from engine.model import DecoderModel
from engine.model.decoder import DecoderLayer
from engine.model_config import FAMILIES, ModelConfig, UnsupportedConfig, eos_token_ids
from engine.ops import ALL_KERNELS, KernelOptions
from engine.presets import PRESET_QUANTIZATION, PRESET_SEED, PRESETS
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# per-layer KV scales: self_attn.k_scale (compressed-tensors, AutoFP8), self_attn.k_proj.k_scale (ModelOpt) or
# self_attn.k_proj.output_scale (older AutoFP8); the same for v
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_proj\.(?:\2_scale|output_scale)|([kv])_scale)")


class ModelLoadError(Exception):
    """The checkpoint can't be used; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: str
    kv_scales: tuple[tuple[float, float], ...] = ()  # (k_scale, v_scale) a layer folded into the weights


def _build_empty(what: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                 kernels: KernelOptions) -> DecoderModel:
    """The model's modules on `device` in `dtype`, unfilled; refused in one line where its weights would not fit
    in what the device has free (every weight is made in `dtype` first, FP8 ones too, so that is the peak)."""
    with torch.device("meta"):
        model = DecoderModel(cfg, kernels, max_positions).to(dtype)
    count = sum(p.numel() for p in model.parameters())
    if cfg.tie_word_embeddings:  # one matrix, not yet tied on the meta device
        count -= cfg.vocab_size * cfg.hidden_size
    need, free = count * dtype.itemsize, free_memory(device)
    if free is not None and need > free:
        advice = ("use --preset tiny or a smaller checkpoint, or a GPU" if device.type == "cpu"
                  else "free the GPU, use one with more memory, or serve a smaller model")
        raise ModelLoadError(f"{what}: its {count / 1e9:.1f} billion weights take {need / 1e9:.1f} GB in "
                             f"{dtype_name(dtype)} on {device}, which has {free / 1e9:.1f} GB free; {advice}")
    log.info("%s: making %.1f billion weights (%.1f GB in %s) on %s", what, count / 1e9, need / 1e9, dtype_name(dtype),
             device)
    model = model.to_empty(device=device)
    model.tie_weights()
    model.rope.reset()
    return model.eval()


def _preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def build_preset(name: str, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
                 kernels: KernelOptions = ALL_KERNELS, quantization: str | None = None) -> LoadedModel:
    cfg = _preset_config(name)
    if (quantization or PRESET_QUANTIZATION.get(name)) == "fp8" and (refusal := weights_refusal(
            f"preset {name} has FP8 weights", device, dtype, "use a 16-bit preset on this GPU")):
        raise ModelLoadError(refusal)
    model = _build_empty(f"preset {name}", cfg, device, dtype, max_positions or cfg.max_position_embeddings, kernels)
    gen = torch.Generator(device=device).manual_seed(PRESET_SEED)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # 1/sqrt(fan_in): activations stay O(1) at any width and depth, so greedy tokens vary with
            # the prompt (0.02 everywhere collapses to one repeated token) without the network turning
            # chaotic (at 2/sqrt(fan_in), 28 layers amplify bf16 rounding to 14% of the logits).
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif pname.startswith("embed"):
                p.normal_(0.0, 1.0, generator=gen)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.1, generator=gen)
    if (quantization or PRESET_QUANTIZATION.get(name)) == "fp8":  # random weights, quantized as loaded ones are
        quantize_model(model, [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS],
                       device.type == "cuda")
    tokenizer: Tokenizer | None = byte_tokenizer() if name == "tiny" else None
    return LoadedModel(model, cfg, tokenizer, f"preset:{name}")


def read_config(folder: Path) -> ModelConfig:
    """The folder's config.json as our config, refusing what the engine does not implement."""
    from transformers import AutoConfig

    hint = "pass a local Hugging Face checkpoint folder (config.json + *.safetensors) or --preset"
    if not folder.is_dir():
        raise ModelLoadError(f"--model {folder}: no such folder; {hint}")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"--model {folder}: no config.json in it; {hint}")
    try:
        raw = json.loads((folder / "config.json").read_text())
        model_type = raw.get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelLoadError(f"--model {folder}: config.json is not a JSON object ({e}); {hint}") from e
    read_quantization(folder, raw)
    if model_type not in FAMILIES:
        raise ModelLoadError(f"--model {folder}: model_type {model_type!r} is not supported; use a checkpoint of "
                             f"one of: {', '.join(FAMILIES)}")
    try:
        hf = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"--model {folder}: transformers can't read its config.json ({e}); fix the file "
                             "or use another checkpoint") from e
    try:
        return ModelConfig.from_hf(hf, name=folder.name)
    except UnsupportedConfig as e:
        raise ModelLoadError(f"--model {folder}: {e}") from e


def read_quantization(folder: Path, raw: dict[str, object] | None = None) -> Fp8Format | None:
    """The checkpoint's FP8 format, None when unquantized; any other quantization is refused. Older
    ModelOpt exports keep theirs in hf_quant_config.json, not config.json."""
    raw = raw if raw is not None else json.loads((folder / "config.json").read_text())
    config = raw.get("quantization_config")
    if config is None and (folder / MODELOPT_FILE).is_file():
        try:
            config = {**json.loads((folder / MODELOPT_FILE).read_text()), "quant_method": "modelopt"}
        except (json.JSONDecodeError, TypeError) as e:
            raise ModelLoadError(f"--model {folder}: {MODELOPT_FILE} is not a JSON object ({e}); re-export "
                                 "the checkpoint") from e
    if config is None:
        return None
    try:
        return read_format(config)
    except UnsupportedQuantization as e:
        raise ModelLoadError(f"--model {folder}: {e}; use an unquantized (bf16, fp16 or fp32) checkpoint or one "
                             "of those") from e


def _fp8_layers(folder: Path, cfg: ModelConfig, fmt: Fp8Format) -> dict[str, list[tuple[str, slice]]]:
    """The linear layers whose checkpoint modules are FP8 (all of a fused layer's parts or none)."""
    chosen = {}
    for ours, parts in linear_parts(cfg).items():
        flags = {fmt.quantizes(theirs) for theirs, _ in parts}
        if len(flags) > 1:
            raise ModelLoadError(f"--model {folder}: the quantization_config's ignore list keeps part of "
                                 f"{', '.join(t for t, _ in parts)} unquantized; these run as one projection, so "
                                 "ignore all of them or none")
        if flags == {True}:
            chosen[ours] = parts
    return chosen


def _fill_fp8(folder: Path, layer: Fp8Linear, parts: list[tuple[str, slice]],
              pieces: dict[str, dict[str, torch.Tensor]], fmt: Fp8Format) -> None:
    """Fill an Fp8Linear from its modules' e4m3 weights and scales (and static input scales: the
    largest of a fused layer's parts, as vLLM does, since they share one input)."""
    needed = ("weight", fmt.scale_name) + (("input_scale",) if fmt.static_input else ())
    for theirs, rows in parts:
        got = pieces.get(theirs, {})
        if missing := [f"{theirs}.{n}" for n in needed if n not in got]:
            raise ModelLoadError(f"--model {folder}: {', '.join(missing)} missing from an FP8 ({fmt.method}) "
                                 "checkpoint; re-download or re-export it")
        weight, scale = got["weight"], got[fmt.scale_name]
        n = len(range(*rows.indices(layer.out_features)))
        if weight.dtype != FP8 or tuple(weight.shape) != (n, layer.in_features):
            raise ModelLoadError(f"--model {folder}: {theirs}.weight is {weight.dtype} {tuple(weight.shape)}; an "
                                 f"FP8 checkpoint's is float8_e4m3fn {(n, layer.in_features)}")
        want = scale_shapes(fmt, n, layer.in_features)
        if tuple(scale.shape) not in want:
            raise ModelLoadError(f"--model {folder}: {theirs}.{fmt.scale_name} has shape {tuple(scale.shape)}; "
                                 f"{fmt.weight} scales of this weight have {' or '.join(map(str, want))}")
        if scale.dim() == 4:  # ModelOpt's blocks, [rows, 1, columns, 1]
            scale = scale.reshape(want[0])
        if layer.weight_scale is not None:
            layer.set_rows(rows, *to_per_channel(weight, scale, fmt))
        else:
            layer.set_rows(rows, dequantize(weight, scale, fmt), None)
        if layer.input_scale is not None:
            layer.input_scale.fill_(max(float(layer.input_scale), float(got["input_scale"].float().max())))
        # transformers' FbgemmFp8Linear once saved its bound as a parameter: the config's, or a contradiction
        if "input_scale_ub" in got and not torch.allclose(got["input_scale_ub"].float(),
                                                          torch.tensor(fmt.input_bound or 0.0)):
            raise ModelLoadError(f"--model {folder}: {theirs}.input_scale_ub is {got['input_scale_ub'].tolist()} but "
                                 f"the quantization_config's activation_scale_ub is {fmt.input_bound}; make them agree")


def fold_kv_scales(model: DecoderModel, scales: torch.Tensor) -> None:
    """Per-layer KV scales `scales` [layers, 2] (k_scale, v_scale) folded into the weights, so the
    cache holds K / k_scale and V / v_scale at scale 1.0 with no kernel reading a scale: q is
    multiplied by k_scale (q . k unchanged), K and V divided by theirs, and o_proj multiplied by
    v_scale (attention is linear in V). In Qwen3 the per-head q/k norms take the factors, since they
    would cancel one on the projection. A static input scale on o_proj, calibrated on attention's
    output, is divided by v_scale, so its now V / v_scale input rounds to the same e4m3 values."""
    for layer, (k_scale, v_scale) in zip(model.layers, scales.tolist(), strict=True):
        assert isinstance(layer, DecoderLayer)
        q = layer.num_heads * layer.head_dim
        kv = layer.num_kv_heads * layer.head_dim
        if layer.q_norm is not None and layer.k_norm is not None:
            layer.q_norm.weight.data *= k_scale
            layer.k_norm.weight.data /= k_scale
        else:
            scale_rows(layer.qkv, slice(0, q), k_scale)
            scale_rows(layer.qkv, slice(q, q + kv), 1 / k_scale)
        scale_rows(layer.qkv, slice(q + kv, q + 2 * kv), 1 / v_scale)
        if isinstance(layer.o_proj, Fp8Linear) and layer.o_proj.weight_scale is not None:
            layer.o_proj.weight_scale *= v_scale  # every column by one factor: the row scales
        else:
            layer.o_proj.weight.data *= v_scale
        if isinstance(layer.o_proj, Fp8Linear) and layer.o_proj.input_scale is not None:
            layer.o_proj.input_scale /= v_scale


def _generation_eos(folder: Path) -> tuple[int, ...]:
    """End-of-turn ids that generation_config.json adds (Llama 3 instruct lists three)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    return eos_token_ids(json.loads(path.read_text()).get("eos_token_id"))


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype,
                    max_positions: int | None = None, kernels: KernelOptions = ALL_KERNELS,
                    quantization: str | None = None) -> LoadedModel:
    """With `quantization` "fp8", an unquantized checkpoint's decoder layers are quantized per output
    channel at load. FP8 weights stay FP8 on CUDA; elsewhere they are dequantized (the reference path)."""
    folder = Path(path)
    cfg = read_config(folder)
    fmt = read_quantization(folder)
    fp8_weights = fmt is not None and fmt.weight != "none"  # not a KV-only config
    if fmt is not None and fp8_weights and quantization is not None:
        raise ModelLoadError(f"--model {folder} is already quantized ({fmt.method}); drop --quantization")
    if fp8_weights or quantization == "fp8":
        what = f"--model {folder} has FP8 weights" if fp8_weights else "--quantization fp8 makes FP8 weights"
        if refusal := weights_refusal(what, device, dtype, "serve a 16-bit checkpoint on this GPU"):
            raise ModelLoadError(refusal)
    extra_eos = tuple(e for e in _generation_eos(folder) if e not in cfg.eos_token_ids)
    cfg = replace(cfg, eos_token_ids=cfg.eos_token_ids + extra_eos)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"--model {folder}: no *.safetensors files in it; pass a folder with the weights "
                             "(sharded with model.safetensors.index.json or not)")
    model = _build_empty(f"--model {folder}", cfg, device, dtype, max_positions or cfg.max_position_embeddings,
                         kernels)
    keep_fp8 = device.type == "cuda"
    fp8_layers = _fp8_layers(folder, cfg, fmt) if fmt is not None else {}
    if fmt is not None:
        replace_linears(model, fp8_layers, keep_fp8, fmt.static_input, fmt.input_bound)
    fp8_modules = {theirs for parts in fp8_layers.values() for theirs, _ in parts}
    fp8_suffixes = () if fmt is None else ("weight", fmt.scale_name) + (("input_scale",) if fmt.static_input else ()) \
        + (("input_scale_ub",) if fmt.input_bound is not None else ())
    pieces: dict[str, dict[str, torch.Tensor]] = {}  # FP8 module -> its weight and scales, read in any order
    params = dict(model.named_parameters())
    names = weight_map(cfg)
    filled: dict[str, int] = {}
    tied_copies: list[torch.Tensor] = []  # an lm_head saved beside tied embeddings: must be their copy
    kv_scales = torch.full((cfg.num_layers, 2), float("nan"))  # k_scale, v_scale a layer, where the format has them
    folded: tuple[tuple[float, float], ...] = ()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    module, _, suffix = name.rpartition(".")
                    kv_scale = _KV_SCALE.fullmatch(name) if fmt is not None and fmt.kv_scales else None
                    if kv_scale is not None and int(kv_scale[1]) < cfg.num_layers:
                        kind = "kv".index(kv_scale[2] or kv_scale[3])
                        kv_scales[int(kv_scale[1]), kind] = float(f.get_tensor(name).float().max())
                        continue
                    if module in fp8_modules and suffix in fp8_suffixes:
                        pieces.setdefault(module, {})[suffix] = f.get_tensor(name)
                        continue
                    target = names.get(name)
                    if target is None:
                        if is_harmless(name):
                            log.info("ignoring unused weight %s in %s", name, file.name)
                            continue
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            tied_copies.append(f.get_tensor(name))
                            continue
                        raise ModelLoadError(f"--model {folder}: "
                                             f"{unused_weight_message(name, file.name, cfg.family)}")
                    ours, rows = target
                    tensor = f.get_tensor(name)
                    if tensor.dtype == FP8:
                        raise ModelLoadError(f"--model {folder}: {name} is float8 but its quantization_config "
                                             "(or its absence) says unquantized; fix config.json")
                    dest = params[ours] if rows is None else params[ours][rows]
                    if dest.shape != tensor.shape:
                        raise ModelLoadError(f"--model {folder}: {name} has shape {tuple(tensor.shape)}, "
                                             f"config.json implies {tuple(dest.shape)}")
                    dest.copy_(tensor.to(dtype))
                    filled[ours] = filled.get(ours, 0) + tensor.shape[0]
        for ours, parts in fp8_layers.items():
            assert fmt is not None
            layer = model.get_submodule(ours)
            assert isinstance(layer, Fp8Linear)
            _fill_fp8(folder, layer, parts, pieces, fmt)
            filled[f"{ours}.weight"] = layer.out_features
        if fmt is not None and fmt.kv_scales:
            if kv_scales.isnan().any() or (kv_scales <= 0).any():
                raise ModelLoadError(f"--model {folder}: its FP8 KV scheme needs a positive k_scale and v_scale in "
                                     "every layer's self_attn; some are missing or not positive; re-export it")
            fold_kv_scales(model, kv_scales)
            folded = tuple((k, v) for k, v in kv_scales.tolist())
        if fmt is not None and not fp8_weights:
            log.info("KV scales (%s): folded into the 16-bit weights; the checkpoint quantizes no weight", fmt.method)
        elif fmt is not None:
            kept = len(linear_parts(cfg)) - len(fp8_layers)
            inputs = ", static input scales" if fmt.static_input else \
                f", input scales bounded by {fmt.input_bound:g} / 448" if fmt.input_bound else ""
            log.info("FP8 weights (%s, %s scales%s): %d projections %s%s%s", fmt.method, fmt.weight, inputs,
                     len(fp8_layers),
                     "in e4m3" if keep_fp8 else f"dequantized to {dtype} (the reference path)",
                     f", {kept} unquantized as the checkpoint has them" if kept else "",
                     "; KV scales folded into the weights" if folded else "")
        if quantization == "fp8":
            quantize_model(model, [f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in LINEARS], keep_fp8)
            params = dict(model.named_parameters())
    if any(not torch.equal(t.to(dtype), params["embed.weight"].cpu()) for t in tied_copies):
        raise ModelLoadError(f"--model {folder}: lm_head.weight differs from the embedding, but config.json has "
                             "tie_word_embeddings true; fix the config (false) or drop the weight")
    missing = [n for n, p in params.items() if filled.get(n, 0) < p.shape[0]]  # a tied lm_head is not listed
    if missing:
        raise ModelLoadError(f"--model {folder}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    try:
        tokenizer = Tokenizer.maybe_from_folder(folder)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"--model {folder}: its tokenizer files can't be loaded ({e}); fix or remove "
                             "them (without them the server takes token ids only)") from e
    return LoadedModel(model, cfg, tokenizer, str(folder), folded)


def load_tokenizer(folder: str, vocab_size: int) -> Tokenizer:
    """`--tokenizer`: a folder's tokenizer in place of the model's own; refused when it has none, or names
    ids past the model's vocabulary (they would index past its embedding)."""
    path = Path(folder)
    try:
        tokenizer = Tokenizer.maybe_from_folder(path) if path.is_dir() else None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"--tokenizer {folder}: its tokenizer files can't be loaded ({e})") from e
    if tokenizer is None:
        raise ModelLoadError(f"--tokenizer {folder}: no tokenizer files there; give a folder with a tokenizer.json")
    if (top := max(tokenizer.hf.get_vocab().values(), default=0)) >= vocab_size:
        raise ModelLoadError(f"--tokenizer {folder}: it has ids up to {top}, past the model's vocabulary of "
                             f"{vocab_size}; use a tokenizer made for this model")
    return tokenizer


def model_context(model_path: str | None, preset: str | None) -> int:
    """The longest sequence the model's config allows (its max_position_embeddings), read before loading;
    a folder's config is checked as `load_checkpoint` checks it."""
    if model_path:
        return read_config(Path(model_path)).max_position_embeddings
    return _preset_config(preset or "tiny").max_position_embeddings


def load_model(model_path: str | None, preset: str | None, device: torch.device, dtype: torch.dtype,
               max_positions: int | None = None, kernels: KernelOptions = ALL_KERNELS,
               quantization: str | None = None) -> LoadedModel:
    if quantization not in (None, "fp8"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported; use fp8 or none")
    if model_path:
        return load_checkpoint(model_path, device, dtype, max_positions, kernels, quantization)
    return build_preset(preset or "tiny", device, dtype, max_positions, kernels, quantization)
