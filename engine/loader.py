"""Build the model on a device: from a local Hugging Face checkpoint folder, or a built-in preset."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import Qwen2Model
from engine.model_config import ModelConfig
from engine.ops import ALL_KERNELS, KernelOptions
from engine.presets import PRESET_SEED, PRESETS
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen2",)


class ModelLoadError(Exception):
    """The checkpoint can't be used; the message says why and what to do."""


@dataclass
class LoadedModel:
    model: Qwen2Model
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: str


def _build_empty(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
                 kernels: KernelOptions) -> Qwen2Model:
    with torch.device("meta"):
        model = Qwen2Model(cfg, kernels, max_positions).to(dtype)
    model = model.to_empty(device=device)
    model.rope.reset()
    return model.eval()


def build_preset(name: str, device: torch.device, dtype: torch.dtype, max_positions: int | None = None,
                 kernels: KernelOptions = ALL_KERNELS) -> LoadedModel:
    if name not in PRESETS:
        raise ModelLoadError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]
    model = _build_empty(cfg, device, dtype, max_positions or cfg.max_position_embeddings, kernels)
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
    tokenizer: Tokenizer | None = ByteTokenizer() if name == "tiny" else None
    return LoadedModel(model, cfg, tokenizer, f"preset:{name}")


def _hf_to_ours(cfg: ModelConfig, name: str) -> tuple[str, slice | None] | None:
    """Our parameter name (and row slice of a fused weight) for a transformers weight name."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name], None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    prefix = f"layers.{parts[2]}."
    rest = ".".join(parts[3:])
    table: dict[str, tuple[str, slice | None]] = {
        "input_layernorm.weight": ("input_norm.weight", None),
        "post_attention_layernorm.weight": ("post_norm.weight", None),
        "self_attn.o_proj.weight": ("o_proj.weight", None),
        "mlp.down_proj.weight": ("down.weight", None),
        "mlp.gate_proj.weight": ("gate_up.weight", slice(0, i)),
        "mlp.up_proj.weight": ("gate_up.weight", slice(i, 2 * i)),
    }
    for kind, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
        table[f"self_attn.{kind}_proj.weight"] = ("qkv.weight", rows)
        table[f"self_attn.{kind}_proj.bias"] = ("qkv.bias", rows)
    if rest not in table:
        return None
    ours, row_slice = table[rest]
    return prefix + ours, row_slice


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype,
                    max_positions: int | None = None, kernels: KernelOptions = ALL_KERNELS) -> LoadedModel:
    folder = Path(path)
    hint = "pass a local Hugging Face checkpoint folder (config.json + *.safetensors) or --preset"
    if not folder.is_dir():
        raise ModelLoadError(f"--model {folder}: no such folder; {hint}")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"--model {folder}: no config.json in it; {hint}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"--model {folder}: no *.safetensors files in it; {hint}")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(folder)
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"--model {folder}: model_type {hf.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    cfg = ModelConfig.from_hf(hf, name=folder.name)
    model = _build_empty(cfg, device, dtype, max_positions or cfg.max_position_embeddings, kernels)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = _hf_to_ours(cfg, name)
                    if target is None:
                        log.warning("ignoring unexpected weight %s in %s", name, file.name)
                        continue
                    ours, rows = target
                    tensor = f.get_tensor(name)
                    dest = params[ours] if rows is None else params[ours][rows]
                    if dest.shape != tensor.shape:
                        raise ModelLoadError(f"--model {folder}: {name} has shape {tuple(tensor.shape)}, "
                                             f"config.json implies {tuple(dest.shape)}")
                    dest.copy_(tensor.to(dtype))
                    filled[ours] = filled.get(ours, 0) + tensor.shape[0]
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = [n for n, p in params.items() if n not in tied and filled.get(n, 0) < p.shape[0]]
    if missing:
        raise ModelLoadError(f"--model {folder}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    return LoadedModel(model, cfg, HFTokenizer.maybe_load(folder), str(folder))


def load_model(model_path: str | None, preset: str | None, device: torch.device, dtype: torch.dtype,
               max_positions: int | None = None, kernels: KernelOptions = ALL_KERNELS) -> LoadedModel:
    if model_path:
        return load_checkpoint(model_path, device, dtype, max_positions, kernels)
    return build_preset(preset or "tiny", device, dtype, max_positions, kernels)
