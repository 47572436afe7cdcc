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


def test_attention_rows_bucket_prompts_on_cuda() -> None:
    """Whole-prompt attention pads CUDA prompts to a bounded set of lengths (cuDNN plans per shape),
    wasting at most an eighth past 256 tokens, powers of two exactly; CPU prompts stay as they are."""
    from engine.attention import attention_rows

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows = [attention_rows(n, cuda) for n in range(1, 32769)]
    assert all(r >= n for n, r in enumerate(rows, 1))
    assert all(r <= n * 1.125 for n, r in enumerate(rows, 1) if n >= 256)
    assert all(attention_rows(1 << e, cuda) == 1 << e for e in range(4, 17))
    assert len(set(rows)) <= 80
    assert all(attention_rows(n, cpu) == n for n in (1, 1000, 32769))


def test_paddedwhole_prompt_attention_matches_unpadded() -> None:
    """Zero rows after a prompt change nothing before them under the causal mask."""
    from engine.attention import whole_prompt_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(37, 4, 16), torch.randn(37, 2, 16), torch.randn(37, 2, 16)
    pq, pk, pv = (torch.cat((t, torch.zeros(11, *t.shape[1:]))) for t in (q, k, v))
    assert torch.allclose(whole_prompt_attention(pq, pk, pv)[:37], whole_prompt_attention(q, k, v), atol=1e-6)


def test_fp8_attention_takes_only_long_16bit_prompts_it_has_a_plan_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """`whole_prompt_attention(fp8=True)` goes to cuDNN's FP8 attention (here stood in for) only for
    16-bit q of at least `MIN_ROWS` rows whose shape has a plan; the rest take the 16-bit route."""
    from engine import attention_fp8
    from engine.attention import whole_prompt_attention

    calls: list[int] = []
    monkeypatch.setattr(attention_fp8, "MIN_ROWS", 32)
    monkeypatch.setattr(attention_fp8, "supports", lambda rows, heads, kv_heads, dim, device: heads != 6)

    def stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape[0])
        return torch.zeros_like(q)

    monkeypatch.setattr(attention_fp8, "fp8_causal_attention", stand_in)
    for rows, heads, dtype, fp8 in [(40, 4, torch.bfloat16, True), (31, 4, torch.bfloat16, False),
                                    (40, 4, torch.float32, False), (40, 6, torch.bfloat16, False)]:
        q, k, v = (torch.randn(rows, h, 16).to(dtype) for h in (heads, 2, 2))
        before = len(calls)
        out = whole_prompt_attention(q, k, v, fp8=True)
        assert (len(calls) > before) == fp8
        assert torch.equal(out, torch.zeros_like(q) if fp8 else whole_prompt_attention(q, k, v))
    assert calls == [40]


def test_last_row_attention_is_the_last_row_of_causal_attention() -> None:
    """A prefill's last layer attends with its last row only: the same values as that row of the
    whole causal attention, with and without a cached prefix in the pool."""
    from engine.attention import PrefillMeta, last_row_attention, prefill_attention, whole_prompt_attention
    from engine.kv_cache import KVLayout, KVPool

    torch.manual_seed(7)
    q, k, v = torch.randn(37, 4, 16), torch.randn(37, 2, 16), torch.randn(37, 2, 16)
    pool = KVPool(KVLayout("m", "float32", 1, 2, 16, 4), 16, torch.device("cpu"))
    whole = PrefillMeta(new_slots=torch.arange(37), prior_slots=None)
    assert torch.allclose(last_row_attention(q[-1:], k, v, pool, 0, whole), whole_prompt_attention(q, k, v)[-1:],
                          atol=1e-6)
    pool.write(0, torch.arange(30), torch.stack((k[:30], v[:30])))  # the first 30 tokens cached
    chunk = PrefillMeta(new_slots=torch.arange(30, 37), prior_slots=torch.arange(30))
    full = prefill_attention(q[30:], k[30:], v[30:], pool, 0, chunk)
    assert torch.allclose(last_row_attention(q[-1:], k[30:], v[30:], pool, 0, chunk), full[-1:], atol=1e-6)
    assert torch.allclose(full[-1:], whole_prompt_attention(q, k, v)[-1:], atol=1e-5)
