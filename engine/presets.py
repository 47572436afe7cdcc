"""Built-in model shapes: random weights from a fixed seed, no download needed."""

from __future__ import annotations

from dataclasses import replace

from engine.model_config import Llama3RopeScaling, ModelConfig

# A model small enough for any laptop and CI; vocabulary = the byte tokenizer's 256 bytes + specials
# (engine.byte_tokenizer, which also gives it a chat template).
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

# Llama-3.1-8B-Instruct's shape: no biases, Llama 3's RoPE scaling, a 128k context, and the
# instruct checkpoint's three end-of-turn ids.
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    eos_token_ids=(128001, 128008, 128009),
    name="llama3-8b",
    family="llama",
    qkv_bias=False,
    rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192),
)

PRESETS: dict[str, ModelConfig] = {"tiny": TINY, "qwen2.5-7b": QWEN25_7B, "llama3-8b": LLAMA3_8B,
                                   "qwen2.5-7b-fp8": replace(QWEN25_7B, name="qwen2.5-7b-fp8")}
# Presets whose decoder layers are quantized at load (per output channel; the lm_head stays 16-bit,
# as FP8 checkpoints keep it).
PRESET_QUANTIZATION: dict[str, str] = {"qwen2.5-7b-fp8": "fp8"}
PRESET_SEED = 1234
