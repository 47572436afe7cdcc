"""`bench.micro.mode_parity` on the CPU: every prefill mode leaves the whole prompt's sequence behind
(float32, tiny preset), and the comparison names where two runs part and by how much."""

from __future__ import annotations

import pytest
import torch

from bench.micro.mode_parity import Run, compare, run
from engine.offline import make_runner


@pytest.mark.parametrize("mode", ["chunked:64", "chunked:256", "layered"])
def test_every_mode_matches_the_whole_prompt_on_the_cpu(mode: str) -> None:
    runner = make_runner(preset="tiny", max_model_len=1024)
    prompt = torch.randint(0, runner.config.vocab_size, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = run(runner, prompt, 8, "whole", layer_slice_tokens=700 * 3)
    row = compare(700, mode, ref, run(runner, prompt, 8, mode, layer_slice_tokens=700 * 3))
    assert row.first_token_equal and row.first_divergence is None
    assert row.first_logits_rel_err < 1e-5 and row.kv_rel_err_max < 1e-5
    assert runner.pool.allocator.num_free == runner.pool.allocator.num_blocks  # the tables were freed


def test_compare_finds_the_parting_step_and_its_margin() -> None:
    logits = [torch.tensor([3.0, 2.9, 0.0]), torch.tensor([0.0, 5.0, 4.0])]
    kv = [torch.ones(2, 4, 1, 2)]
    ref = Run([0, 1], logits, kv)
    near = Run([0, 2], [logits[0], torch.tensor([0.0, 4.4, 4.5])], kv)
    row = compare(4, "chunked:2", ref, near)
    assert row.first_token_equal and row.first_divergence == 1
    assert row.margin_at_divergence == pytest.approx(1.0) and row.logit_gap_at_divergence == pytest.approx(0.6)
    assert row.rounding_flip  # twice the gap covers the margin: two near-tied logits swapped
    far = Run([2, 2], [torch.tensor([0.0, 0.0, 9.0]), logits[1]], [kv[0] * 3])
    row = compare(4, "chunked:2", ref, far)
    assert not row.first_token_equal and row.first_divergence == 0 and row.kv_rel_err_max == pytest.approx(2.0)
