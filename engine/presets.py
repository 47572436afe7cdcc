"""Built-in model shapes: random weights from a fixed seed, no download needed."""

from __future__ import annotations

from engine.model_config import ModelConfig

# A model small enough for any laptop and CI; vocabulary = the byte tokenizer's 256 bytes + specials.
TINY = ModelConfig(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    eos_token_ids=(257,),
    name="tiny",
)

# Qwen2.5-7B-Instruct's shape. Its context is 32,768 natively and 131,072 with YaRN; the preset
# allows the longer one so a 32k prompt plus its answer fits (speed does not depend on the values).
QWEN25_7B = ModelConfig(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    eos_token_ids=(151645, 151643),
    name="qwen2.5-7b",
)

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "qwen2.5-7b": QWEN25_7B}
PRESET_SEED = 1234
