"""Shared fixtures: tiny random checkpoints and real server processes on free loopback ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


def write_tiny_checkpoint(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """A tiny random Qwen2 checkpoint written by transformers itself (config.json + safetensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
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


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def pair(server_logs: Path):  # type: ignore[no-untyped-def]
    """A prefill server and a decode server (tiny preset, CPU) paired over gRPC, shared by a session."""
    from tests.servers import ServerProcess

    prefill = ServerProcess("prefill_server", [], server_logs).start()
    decode = ServerProcess("decode_server", ["--prefill-addr", prefill.address], server_logs).start()
    yield decode, prefill
    decode.stop()
    prefill.stop()
