"""Shared fixtures: tiny random checkpoints and real server processes on free loopback ports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """A tiny random Qwen2 checkpoint written by transformers itself (config.json + safetensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields: dict[str, object] = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                     rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=299)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**fields)).eval()
    with torch.no_grad():  # larger than the default init so greedy tokens vary with the prompt
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2")
