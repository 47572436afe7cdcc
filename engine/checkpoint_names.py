"""Which tensors of a checkpoint the loader may leave unread, and what an unread one means.

A weight the model does not use is refused at start unless it is listed here as harmless: a
quantized checkpoint's scales, zero points or group indices served without them give wrong tokens
and no error, so nothing is skipped that is not known to be safe to skip.
"""

from __future__ import annotations

import re

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
