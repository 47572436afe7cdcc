"""The decoder's shape and its family's differences, read from a Hugging Face config or a preset.

One model module serves Llama 3.x, Qwen2/2.5, Qwen3 and Mistral: what differs between them is a
field here (`qkv_bias`, `qk_norm`, `rope_scaling`, `tie_word_embeddings`), never a copy of the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

# transformers' model_type -> whether q, k and v have a bias and whether q and k get a per-head RMSNorm.
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


class UnsupportedConfig(ValueError):
    """The config asks for something this engine does not implement; the message says what."""


def eos_token_ids(value: object) -> tuple[int, ...]:
    """A config's eos_token_id (one id, a list of them, or none) as a tuple."""
    if isinstance(value, list | tuple):
        return tuple(int(e) for e in value)
    return () if value is None else (int(value),)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    name: str = "qwen2"
    family: str = "qwen2"
    qkv_bias: bool = True
    qk_norm: bool = False
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {sorted(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive")

    @classmethod
    def from_hf(cls, hf: Any, name: str | None = None) -> ModelConfig:
        """From a transformers `PretrainedConfig` (or anything with its attribute names), in either
        layout: v5's `rope_parameters` or v4's `rope_theta` + `rope_scaling`."""
        family = hf.model_type
        if family not in FAMILIES:
            raise UnsupportedConfig(f"model_type {family!r} is not supported (supported: {', '.join(FAMILIES)})")
        if getattr(hf, "sliding_window", None) is not None:
            raise UnsupportedConfig(f"sliding_window is {hf.sliding_window}: sliding-window attention is not "
                                    "supported; use a checkpoint whose config.json has \"sliding_window\": null "
                                    "(Mistral v0.2 and later)")
        for flag in ("attention_bias", "mlp_bias"):
            if family != "qwen2" and getattr(hf, flag, False):
                raise UnsupportedConfig(f"{flag} is true: {family} checkpoints with that bias are not supported")
        rope_theta, rope_scaling = _rope(hf)
        qkv_bias, qk_norm = FAMILIES[family]
        eos_ids = eos_token_ids(getattr(hf, "eos_token_id", None))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            name=name or family,
            family=family,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
        )

    def fingerprint(self) -> str:
        """Names the architecture and shapes (not the weights): both servers must load the same one.
        The digest covers every field that changes the KV (family, biases, norms, RoPE)."""
        shape = {k: v for k, v in asdict(self).items() if k not in ("name", "eos_token_ids")}
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
        label = self.name if self.name == self.family else f"{self.name}-{self.family}"
        return f"{label}-{digest}"


def _rope(hf: Any) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from v5's `rope_parameters` or v4's `rope_theta` + `rope_scaling`."""
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", None))
    theta = float(params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, Llama3RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                                        float(params["high_freq_factor"]),
                                        int(params["original_max_position_embeddings"]))
    raise UnsupportedConfig(f"RoPE type {kind!r} is not supported (supported: default, llama3); use a checkpoint "
                            "without that rope_scaling")
