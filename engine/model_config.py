"""The Qwen2-family model shape, read from a Hugging Face config or a built-in preset."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive")

    @classmethod
    def from_hf(cls, hf: Any, name: str = "qwen2") -> ModelConfig:
        """From a transformers `PretrainedConfig` (or anything with its attribute names)."""
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        if rope_theta is None:
            rope_theta = getattr(hf, "rope_theta", 10000.0)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta or 10000.0),
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            name=name,
        )

    def fingerprint(self) -> str:
        """Names the architecture and shapes (not the weights): both servers must load the same one."""
        shape = {k: v for k, v in asdict(self).items() if k not in ("name", "eos_token_ids")}
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.name}-{digest}"
