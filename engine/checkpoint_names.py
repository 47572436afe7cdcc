"""A checkpoint's tensor names: transformers' names for ours (`weight_map`, `linear_parts`), which
tensors the loader may leave unread, and what an unread one means.

A weight the model does not use is refused at start unless it is listed here as harmless: a
quantized checkpoint's scales, zero points or group indices served without them give wrong tokens
and no error, so nothing is skipped that is not known to be safe to skip.
"""

from __future__ import annotations

import re

from engine.model_config import ModelConfig

# Tensors some checkpoints carry that the forward recomputes itself (older transformers saved each
# layer's RoPE inverse frequencies). The only names the loader skips.
HARMLESS_WEIGHTS: tuple[re.Pattern[str], ...] = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)

# Suffixes of quantization tensors (compressed-tensors, HF fp8, GPTQ, AWQ, bitsandbytes) that
# name what the checkpoint is, for the refusal of a checkpoint whose config does not say.
_QUANTIZED_SUFFIXES = ("_scale", "_scale_inv", "_zero_point", ".g_idx", ".qweight", ".qzeros", ".scales",
                       ".absmax", ".quant_map", ".quant_state")


def is_harmless(name: str) -> bool:
    return any(p.search(name) for p in HARMLESS_WEIGHTS)


def unused_weight_message(name: str, file: str, family: str) -> str:
    """One line for a tensor the model has no place for: what it is and what to do."""
    if name.endswith(_QUANTIZED_SUFFIXES):
        return (f"{name} in {file} is a quantization tensor that config.json's quantization_config does not "
                "use (or it has none), so it would be served without it (wrong tokens); use an unquantized "
                "(bf16, fp16 or fp32) checkpoint or an FP8 one whose config names its format")
    return (f"{name} in {file} is not a weight of a {family} model; the checkpoint does not match its "
            "config.json (use the folder transformers saved, unmodified)")


def weight_map(cfg: ModelConfig) -> dict[str, tuple[str, slice | None]]:
    """Every transformers weight name of this config -> our parameter name and, for a fused weight,
    its rows (q, k, v stacked in `qkv`; gate and up in `gate_up`)."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    names: dict[str, tuple[str, slice | None]] = {"model.embed_tokens.weight": ("embed.weight", None),
                                                  "model.norm.weight": ("norm.weight", None)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = ("lm_head.weight", None)
    per_layer: dict[str, tuple[str, slice | None]] = {
        "input_layernorm.weight": ("input_norm.weight", None),
        "post_attention_layernorm.weight": ("post_norm.weight", None),
        "self_attn.o_proj.weight": ("o_proj.weight", None),
        "mlp.down_proj.weight": ("down.weight", None),
        "mlp.gate_proj.weight": ("gate_up.weight", slice(0, i)),
        "mlp.up_proj.weight": ("gate_up.weight", slice(i, 2 * i)),
    }
    for kind, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
        per_layer[f"self_attn.{kind}_proj.weight"] = ("qkv.weight", rows)
        if cfg.qkv_bias:
            per_layer[f"self_attn.{kind}_proj.bias"] = ("qkv.bias", rows)
    if cfg.qk_norm:
        per_layer["self_attn.q_norm.weight"] = ("q_norm.weight", None)
        per_layer["self_attn.k_norm.weight"] = ("k_norm.weight", None)
    for layer in range(cfg.num_layers):
        for theirs, (ours, part) in per_layer.items():
            names[f"model.layers.{layer}.{theirs}"] = (f"layers.{layer}.{ours}", part)
    return names


LINEARS = ("qkv", "o_proj", "gate_up", "down")  # the decoder layer's projections, in memory


def linear_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, slice]]]:
    """Each linear layer of ours (layers.0.qkv, lm_head) -> its transformers modules and their rows."""
    parts: dict[str, list[tuple[str, slice]]] = {}
    for theirs, (ours, rows) in weight_map(cfg).items():
        module = ours.removesuffix(".weight")
        if theirs.endswith(".weight") and (module.rsplit(".", 1)[-1] in LINEARS or module == "lm_head"):
            n = cfg.vocab_size if module == "lm_head" else None
            parts.setdefault(module, []).append((theirs.removesuffix(".weight"), rows or slice(0, n)))
    return parts
