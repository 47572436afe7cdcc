"""The skinny decode matmul on CUDA (`engine.kernels.gemv`): against cuBLAS, its splits, its gated and
argmax epilogues, batch invariance and determinism in graphs. Skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_skinny_gemv_matches_cublas_and_ignores_batch_mates() -> None:
    from engine.kernels.gemv import gemv, supports

    torch.manual_seed(2)
    dev = torch.device("cuda")
    for n, k, has_bias in ((4608, 3584, True), (3584, 18944, False), (1000, 512, False)):
        w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5
        b = torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None
        x = torch.randn(16, k, dtype=torch.bfloat16, device=dev)
        assert supports(x, w)
        full = gemv(x, w, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert rel_err(full, ref) < 1e-2
        for m in (1, 2, 5, 15):
            assert torch.equal(gemv(x[:m], w, b), full[:m])  # a row's result ignores the other rows
        as_float = gemv(x, w, b, out_dtype=torch.float32)  # logits: stored as float32 after the same rounding
        assert as_float.dtype == torch.float32 and torch.equal(as_float, full.float())
    from engine.kernels.gemv import GemvConfig
    w = torch.randn(3584, 18944, dtype=torch.bfloat16, device=dev) * 18944**-0.5
    x = torch.randn(64, 18944, dtype=torch.bfloat16, device=dev)
    for cfg in (GemvConfig(64, 128, 4, 3), GemvConfig(128, 64, 8, 4, 2)):  # the 64-row tile, K whole and split
        full = gemv(x, w, None, cfg)
        assert rel_err(full, torch.nn.functional.linear(x.float(), w.float())) < 1e-2
        for m in (17, 33, 63):
            assert torch.equal(gemv(x[:m], w, None, cfg), full[:m])
        assert torch.equal(gemv(x, w, None, cfg, out_dtype=torch.float32), full.float())


def test_uneven_split_k_sums_every_step_once() -> None:
    """Split counts that do not divide the K steps (shares one step apart) give the unsplit sums to
    rounding, and a row's result still ignores the other rows."""
    from engine.kernels.gemv import GemvConfig, gemv

    torch.manual_seed(4)
    dev = torch.device("cuda")
    w = torch.randn(3584, 18944, dtype=torch.bfloat16, device=dev) * 18944**-0.5
    x = torch.randn(64, 18944, dtype=torch.bfloat16, device=dev)
    ref = torch.nn.functional.linear(x.float(), w.float())
    for cfg in (GemvConfig(128, 128, 4, 4, 5), GemvConfig(32, 256, 4, 4, 3), GemvConfig(256, 64, 8, 3, 9)):
        full = gemv(x, w, None, cfg)
        assert rel_err(full, ref) < 1e-2, cfg
        rows = (17, 40) if cfg.block_n != 32 else (1, 9)
        for m in rows:
            assert torch.equal(gemv(x[:m], w, None, cfg), full[:m])


def test_lm_head_argmax_epilogue_is_torch_argmax() -> None:
    """The lm_head's epilogue argmax gives the tokens logits.argmax gives, the first column among
    equal maxima included, with the same logits, in the 16-row and the 64-row tile."""
    from engine.kernels.gemv import gemv, gemv_argmax

    torch.manual_seed(5)
    dev = torch.device("cuda")
    n, k = 152064, 3584
    w = torch.randn(n, k, dtype=torch.bfloat16, device=dev) * k**-0.5
    for m in (1, 7, 16, 17, 64):
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        logits, tokens = gemv_argmax(x, w, out_dtype=torch.float32)
        assert torch.equal(logits, gemv(x, w, out_dtype=torch.float32))
        assert torch.equal(tokens, logits.argmax(-1))
    x = torch.randn(64, k, dtype=torch.bfloat16, device=dev)
    tied = w.clone()
    for row in range(64):  # each row's best column copied to later columns, in its strip and in others
        best = int((x[row:row + 1].float() @ w.float().T).argmax())
        for col in (best + 1, best + 700, n - 1):
            if col < n:
                tied[col] = w[best]
        tied[max(best - 3, 0)] = w[best]  # and one before it: the first of them wins
    logits, tokens = gemv_argmax(x, tied, out_dtype=torch.float32)
    assert int(((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).sum()) >= 32  # the ties are real
    assert torch.equal(tokens, logits.argmax(-1))


def test_gated_gemv_is_gemv_then_silu_mul() -> None:
    """The decode MLP's SiLU·mul in the gate/up matmul's epilogue gives the bits of the matmul
    followed by the SiLU·mul kernel, at both tiles, and a row's result ignores its batch mates."""
    from engine.kernels.fused import silu_mul
    from engine.kernels.gemv import gated_config_for, gemv, gemv_silu

    torch.manual_seed(4)
    dev = torch.device("cuda")
    w = torch.randn(2 * 18944, 3584, dtype=torch.bfloat16, device=dev) * 3584**-0.5
    for rows in (16, 64):
        assert gated_config_for(w, rows) is not None
        x = torch.randn(rows, 3584, dtype=torch.bfloat16, device=dev)
        full = gemv_silu(x, w)
        assert torch.equal(full, silu_mul(gemv(x, w)))
        for m in ((1, 2, 9) if rows == 16 else (17, 40)):
            assert torch.equal(gemv_silu(x[:m], w), full[:m])


def test_split_k_gemv_is_deterministic_in_graphs() -> None:
    """Split K: the partial sums are added in split order by whichever program comes last, so
    every call (eager, graphed, replayed many times, beside another stream's calls) gives the same
    bits; the counts are back at zero after each call."""
    from engine.kernels import arrivals
    from engine.kernels import gemv as g

    torch.manual_seed(3)
    dev = torch.device("cuda")
    down = torch.randn(3584, 18944, dtype=torch.bfloat16, device=dev) * 18944**-0.5
    qkv = torch.randn(4608, 3584, dtype=torch.bfloat16, device=dev) * 3584**-0.5
    bias = torch.randn(4608, dtype=torch.bfloat16, device=dev)
    down_cfg, qkv_cfg = g.config_for(down), g.config_for(qkv)
    assert down_cfg is not None and qkv_cfg is not None and down_cfg.split_k > 1 and qkv_cfg.split_k > 1
    x = torch.randn(16, 3584, dtype=torch.bfloat16, device=dev)
    xd = torch.randn(16, 18944, dtype=torch.bfloat16, device=dev)
    want_qkv, want_down = g.gemv(x, qkv, bias), g.gemv(xd, down)
    ref = torch.nn.functional.linear(x.float(), qkv.float(), bias.float())
    assert rel_err(want_qkv, ref) < 1e-2
    assert rel_err(want_down, torch.nn.functional.linear(xd.float(), down.float())) < 1e-2
    one = g.GemvConfig(qkv_cfg.block_n, qkv_cfg.block_k)  # the same tile, K unsplit
    assert rel_err(g.gemv(x, qkv, bias, one), ref) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        g.gemv(x, qkv, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out_qkv = g.gemv(x[:3], qkv, bias)
        out_down = g.gemv(xd[:3], down)
    side = torch.cuda.Stream()
    for _ in range(50):
        graph.replay()
        with torch.cuda.stream(side):  # another stream's split-K calls at the same time
            g.gemv(x, qkv, bias)
        assert torch.equal(out_qkv, want_qkv[:3]) and torch.equal(out_down, want_down[:3])
    torch.cuda.synchronize()
    assert all(int(c.count_nonzero()) == 0 for c in arrivals._counts.values())
