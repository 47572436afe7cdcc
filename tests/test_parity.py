"""Our forward against transformers' own Qwen2ForCausalLM on a checkpoint it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.offline import generate, make_runner

PROMPTS = [[1, 5, 9, 200, 31, 7], [42] * 3 + list(range(60, 100)), [250, 3, 3, 17], list(range(1, 130))]


def hf_greedy(folder: Path, prompt: list[int], steps: int) -> list[int]:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"len{len(p)}" for p in PROMPTS])
def test_greedy_tokens_match_transformers(tiny_checkpoint: Path, prompt: list[int]) -> None:
    runner = make_runner(model=str(tiny_checkpoint), max_model_len=512)
    ours = generate(runner, [prompt], 32)[0]
    assert ours == hf_greedy(tiny_checkpoint, prompt, 32)


def test_batched_and_chunked_match_single(tiny_checkpoint: Path) -> None:
    runner = make_runner(model=str(tiny_checkpoint), max_model_len=512)
    singles = [generate(runner, [p], 24)[0] for p in PROMPTS]
    assert generate(runner, PROMPTS, 24) == singles
    assert [generate(runner, [p], 24, chunk_size=16)[0] for p in PROMPTS] == singles
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks
