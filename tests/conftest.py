"""Shared fixtures: tiny random checkpoints and real server processes on free loopback ports."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop for a scheduler's readers, where the test reads the outputs itself."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


# Tests never reach the hub: every model and tokenizer they load is a folder they wrote.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# What each family's tiny checkpoint has beyond the shared shape: Llama 3.2's tied embeddings and
# Llama 3.1's RoPE scaling (its three frequency bands all present at head_dim 16), Qwen3's explicit
# head_dim (not hidden_size / heads) and q/k norms, Mistral v0.2's absent sliding window.
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "qwen2": dict(rope_theta=10000.0),
    "llama": dict(tie_word_embeddings=True, rms_norm_eps=1e-5, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "qwen3": dict(head_dim=32, rope_theta=1000000.0),
    "mistral": dict(sliding_window=None, rope_theta=1000000.0),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def write_tiny_checkpoint(folder: Path, seed: int = 0, family: str = "qwen2", max_shard_size: str | None = None,
                          **overrides: object) -> Path:
    """A tiny random checkpoint of one family, written by transformers itself (config.json + safetensors,
    in shards with an index when `max_shard_size` is given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields: dict[str, Any] = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=False, eos_token_id=299)
    fields.update(FAMILY_FIELDS[family])
    fields.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields)).eval()
    with torch.no_grad():  # larger than the default init so greedy tokens vary with the prompt
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            elif "norm" in name:  # norms away from 1, so a norm applied wrongly shows
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return folder


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Text whose byte-level merges split characters across tokens: CJK (3 bytes), emoji (4), accents (2).
TOKENIZER_CORPUS = ["Hello world, hello tokens. 漢字かな交じり文 😀😃🎉 naïve café résumé"] * 50


def write_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained here with the `tokenizers` library, saved into `folder`
    with a ChatML chat template, as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TOKENIZER_CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            chat_template=CHATML_TEMPLATE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2")


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def scenario_pair(pair):  # type: ignore[no-untyped-def]
    """The A/B scenario's servers: the default pair, prefix caches on. The scenario sends the same B
    prompt in every row, each row under a cache_salt of its own, so each is prefilled."""
    return pair


@pytest.fixture(scope="session")
def pair(server_logs: Path):  # type: ignore[no-untyped-def]
    """A prefill server and a decode server (tiny preset, CPU) paired over gRPC, shared by a session."""
    from tests.servers import ServerProcess

    prefill = ServerProcess("prefill_server", [], server_logs).start()
    decode = ServerProcess("decode_server", ["--prefill-addr", prefill.address], server_logs).start()
    yield decode, prefill
    decode.stop()
    prefill.stop()
