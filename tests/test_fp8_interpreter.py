"""The FP8 paths of our Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1),
against the dequantized reference: the skinny matmul on e4m3 weights (plain, split-K, gated,
argmax; its MMA tiles and its CUDA-core one), SiLU·mul with its per-token quantization (against
the two kernels in turn), the norm that writes its output's e4m3 rows (against the norm, then the
quantization), the paged decode attention over an e4m3 pool, and a layer's bound on its input's
scales in each of them. Runs where the `triton` package is
installed: `make install` adds it beside the CPU build of torch, which does not bring it.

The interpreter computes in NumPy, which has no bfloat16, so activations are float16 (the matmul)
and float32 (attention); and its own float32 -> e4m3 cast mis-rounds values that carry into the
next power of two, so the kernels' e4m3 stores are left to the GPU tests (tests/test_cuda_fp8.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package")
def test_fp8_kernels_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp8 kernels ok" in proc.stdout


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp8_matrix(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weights [N, K], their row scales, the float32 values they stand for, a float16 bias)."""
    from engine.fp8 import quantize_per_channel

    torch.manual_seed(seed)
    w, scale = quantize_per_channel(torch.randn(n, k) * k**-0.5 * torch.rand(n, 1))
    return w, scale, w.float() * scale[:, None], torch.randn(n, dtype=torch.float16)


def check_gemv() -> None:
    from engine.kernels.gemv import GemvConfig, gemv, gemv_argmax, gemv_silu

    n, k = 96, 256
    w, scale, deq, bias = fp8_matrix(n, k, seed=0)
    for m in (1, 3):
        x = torch.randn(m, k, dtype=torch.float16)
        for cfg in (GemvConfig(32, 128, 4, 2, 1), GemvConfig(32, 64, 4, 2, 2),  # whole K, split in two
                    GemvConfig(32, 64, 4, 2, 2, f16_mma=True),
                    GemvConfig(128, 64, 4, 2, 2)):  # at 3 rows 64 x 128 partials: added in a loop (arrivals)
            assert rel(gemv(x, w, bias, cfg, scale=scale), F.linear(x.float(), deq, bias.float())) < 2e-3, cfg
        gate, up = F.linear(x.float(), deq).half().chunk(2, dim=-1)
        want = (F.silu(gate.float()).half().float() * up.float()).half()
        for cfg in (GemvConfig(16, 128, 4, 2, 1), GemvConfig(16, 128, 4, 2, 1, f16_mma=True)):
            assert rel(gemv_silu(x, w, cfg, scale=scale), want) < 2e-3, cfg
        big = x * 16384  # rows past F16_SAFE: halved in the tile until they fit, their sums doubled back
        assert big.abs().max() > 32768
        cfg = GemvConfig(32, 64, 4, 2, 1, f16_mma=True)
        assert rel(gemv(big, w, None, cfg, scale=scale, out_dtype=torch.float32), F.linear(big.float(), deq)) < 2e-3
        for cfg in (GemvConfig(32, 128, 4, 2, 1), GemvConfig(32, 128, 4, 2, 1, strip_n=20)):
            logits, tokens = gemv_argmax(x, w, torch.float32, cfg, scale=scale)
            assert torch.equal(tokens, logits.argmax(-1)) and rel(logits, F.linear(x.float(), deq)) < 2e-3
        # strips narrower than the tile (96 columns on 20: the last 16), split and gated: the same values
        wide, narrow = GemvConfig(32, 64, 4, 2, 2), GemvConfig(32, 64, 4, 2, 2, strip_n=20)
        assert torch.equal(gemv(x, w, bias, narrow, scale=scale), gemv(x, w, bias, wide, scale=scale))
        wide, narrow = GemvConfig(16, 128, 4, 2, 1), GemvConfig(16, 128, 4, 2, 1, strip_n=12)
        assert torch.equal(gemv_silu(x, w, narrow, scale=scale), gemv_silu(x, w, wide, scale=scale))
    for m in (1, 3, 20):  # W8A8: x quantized per row, in the kernel (1-2 rows) or by a kernel first (3-64)
        # x already on e4m3's grid (its largest magnitude 448 * 2^-8): the interpreter's own cast would
        # mis-round; the rounding itself is the GPU tests'
        x = (torch.randn(m, k) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        x[:, 0] = 448.0
        x = (x / 256).half()
        for cfg in (GemvConfig(32, 128, 4, 2, 1, quantize_x=True), GemvConfig(32, 64, 4, 2, 2, quantize_x=True)):
            assert rel(gemv(x, w, bias, cfg, scale=scale), F.linear(x.float(), deq, bias.float())) < 2e-3, (m, cfg)
        gate, up = F.linear(x.float(), deq).half().chunk(2, dim=-1)
        want = (F.silu(gate.float()).half().float() * up.float()).half()
        assert rel(gemv_silu(x, w, GemvConfig(16, 128, 4, 2, 1, quantize_x=True), scale=scale), want) < 2e-3


def check_gemv_vector() -> None:
    """The CUDA-core tile: plain with a bias, split in three, gated; a row's bits the same at 1 and 2 rows,
    and the same with 1, 2 or 4 rows a program."""
    from engine.kernels.gemv_vector import VectorConfig, gemv_vector

    k = 768
    w, scale, deq, bias = fp8_matrix(96, k, seed=3)
    x = torch.randn(4, k, dtype=torch.float16)
    for cfg in (VectorConfig(16, 256, 4, 1, 1), VectorConfig(8, 256, 4, 2, 3)):
        both = gemv_vector(x[:2], w, scale, cfg, bias=bias)
        assert rel(both, F.linear(x[:2].float(), deq, bias.float())) < 2e-3, cfg
        assert torch.equal(gemv_vector(x[1:2], w, scale, cfg, bias=bias), both[1:]), cfg
    gate, up = F.linear(x.float(), deq).half().chunk(2, dim=-1)
    want = (F.silu(gate.float()).half().float() * up.float()).half()
    for gated, expected in ((False, F.linear(x.float(), deq, bias.float())), (True, want)):
        b = None if gated else bias
        one_a_program = gemv_vector(x, w, scale, VectorConfig(8, 256, 4, 1, 1), bias=b, gated=gated)
        assert rel(one_a_program, expected) < 2e-3, gated
        for block_m in (2, 4):
            cfg = VectorConfig(8, 256, 4, 1, 1, block_m=block_m)
            assert torch.equal(gemv_vector(x, w, scale, cfg, bias=b, gated=gated), one_a_program), (gated, block_m)


def check_silu_mul_quantize() -> None:
    from engine.kernels.fp8_quant import quantize_rows, silu_mul_quantize_rows
    from engine.kernels.fused import silu_mul

    torch.manual_seed(2)
    gu = torch.randn(3, 2 * 1500, dtype=torch.float16) * 4
    gu[1] = 0
    q, scale = silu_mul_quantize_rows(gu, block=512, programs=2)  # steps with a ragged last; a program 2 rows
    want_q, want_scale = quantize_rows(silu_mul(gu))  # the interpreter's e4m3 cast on both sides
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def check_norm_quantize() -> None:
    """The norm that writes its output's e4m3 rows: the output unchanged, the rows `quantize_rows`' bits."""
    from engine.kernels.fp8_quant import quantize_rows
    from engine.kernels.fused import add_rms_norm

    torch.manual_seed(3)
    x, delta = torch.randn(20, 384, dtype=torch.float16), torch.randn(20, 384, dtype=torch.float16)
    weight = torch.rand(384, dtype=torch.float16) * 4
    x_again = x.clone()
    want, none = add_rms_norm(x, weight, 1e-6, delta)
    out, e4m3 = add_rms_norm(x_again, weight, 1e-6, delta, quantize=True)
    assert none is None and e4m3 is not None and torch.equal(out, want) and torch.equal(x_again, x)
    want_q, want_scale = quantize_rows(want)  # the interpreter's e4m3 cast on both sides
    assert torch.equal(e4m3[1], want_scale) and torch.equal(e4m3[0].view(torch.uint8), want_q.view(torch.uint8))


def check_paged_decode() -> None:
    from engine.kernels.fp8_quant import quantize_rows
    from engine.kernels.paged_decode import DecodeTile, paged_decode_attention

    torch.manual_seed(1)
    heads, kv_heads, dim, block = 4, 2, 16, 16
    pool = torch.randn(2, 64 * block, kv_heads, dim).to(torch.float8_e4m3fn)
    q = torch.randn(2, heads, dim)
    tables = torch.tensor([[1, 2, 3, 4, 7, 8, 9, 0], [5, 6, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([100, 20], dtype=torch.int32)
    for splits, tile in [(1, None), (2, None), (2, DecodeTile(16, 3)), (1, DecodeTile(128, 3)),
                         (2, DecodeTile(16, 3, word_loads=True)), (1, DecodeTile(64, 5, 2, word_loads=True)),
                         (8, DecodeTile(16, 3))]:  # 7 slices of 100 tokens: the merge's chunks of 4, one part full
        for e4m3_rows in (False, True):  # True: the merge of a sequence's heads in one program, its e4m3 rows too
            out, rows = paged_decode_attention(q, pool, tables, lens, block, splits=splits, tile=tile,
                                               e4m3_rows=e4m3_rows)
            for b in range(2):
                pos = torch.arange(int(lens[b]))
                slots = tables[b].long()[pos // block] * block + pos % block
                k, v = (pool[i, slots].float().repeat_interleave(heads // kv_heads, 1) for i in (0, 1))
                weights = (torch.einsum("hd,lhd->hl", q[b], k) * dim**-0.5).softmax(-1)
                assert rel(out[b], torch.einsum("hl,lhd->hd", weights, v)) < 1e-5
            assert (rows is not None) == (e4m3_rows and splits > 1)
            if rows is not None:  # the interpreter's e4m3 cast on both sides
                want_q, want_scale = quantize_rows(out.reshape(2, -1))
                assert torch.equal(rows[1], want_scale)
                assert torch.equal(rows[0].view(torch.uint8), want_q.view(torch.uint8))



def check_input_bound() -> None:
    """A layer's `input_bound` (fbgemm_fp8's `activation_scale_ub`) in every kernel that quantizes or reads
    its x: each row's scale capped at bound / 448, its magnitudes past the bound saturated. x is on e4m3's
    grid over the bounded scale 2^-8, so the interpreter's cast is exact, and some values are past it."""
    from engine.kernels.fp8_quant import quantize_rows, silu_mul_quantize_rows
    from engine.kernels.fused import add_rms_norm, silu_mul
    from engine.kernels.gemv import GemvConfig, gemv, gemv_silu
    from engine.kernels.gemv_vector import VectorConfig, gemv_vector
    from engine.kernels.paged_decode import paged_decode_attention

    torch.manual_seed(4)
    bound, k = 448 * 2.0**-8, 256
    grid = (torch.randn(20, k) * 150).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 2.0**-8
    grid[:, :8] *= 4  # past the bound in every row (largest 7.0 > 1.75)
    x = grid.half()
    q, scale = quantize_rows(x, bound)
    assert torch.equal(scale, torch.full((20, 1), 2.0**-8))
    assert torch.equal(q.float(), (grid * 2.0**8).clamp(-448, 448))
    unbounded, wide = quantize_rows(x)
    assert (wide > scale).all() and not torch.equal(unbounded, q)
    clamped = x.float().clamp(-bound, bound)
    w, w_scale, deq, bias = fp8_matrix(96, k, seed=5)
    want = F.linear(clamped, deq, bias.float())
    for m in (1, 3, 20):  # in the 16-row tile (1-16) or by quantize_rows first (the 64-row one)
        for cfg in (GemvConfig(32, 128, 4, 2, 1, quantize_x=True), GemvConfig(32, 128, 4, 2, 1),
                    GemvConfig(32, 64, 4, 2, 2, f16_mma=True)):  # W8A8, then 16-bit x clamped
            got = gemv(x[:m], w, bias, cfg, scale=w_scale, x_bound=bound)
            assert rel(got, want[:m]) < 2e-3, (m, cfg)
            assert rel(gemv(x[:m], w, bias, cfg, scale=w_scale), want[:m]) > 0.05, (m, cfg)
    gate, up = F.linear(clamped[:3], deq).half().chunk(2, dim=-1)
    gated = (F.silu(gate.float()).half().float() * up.float()).half()
    assert rel(gemv_silu(x[:3], w, GemvConfig(16, 128, 4, 2, 1, quantize_x=True), scale=w_scale,
                         x_bound=bound), gated) < 2e-3
    assert rel(gemv_vector(x[:2], w, w_scale, VectorConfig(8, 256, 4, 1, 1), bias=bias, x_bound=bound),
               want[:2]) < 2e-3
    # the kernels that write e4m3 rows for the projection after them: `quantize_rows(rows, bound)`'s bits
    gu = torch.randn(3, 2 * 1500, dtype=torch.float16) * 4
    fused_q, fused_scale = silu_mul_quantize_rows(gu, bound, block=512, programs=2)
    want_q, want_scale = quantize_rows(silu_mul(gu), bound)
    assert torch.equal(fused_scale, want_scale) and (want_scale == bound / 448).any()
    assert torch.equal(fused_q.view(torch.uint8), want_q.view(torch.uint8))
    norm_in, weight = torch.randn(4, 384, dtype=torch.float16), torch.rand(384, dtype=torch.float16) * 4
    out, rows = add_rms_norm(norm_in, weight, 1e-6, None, quantize=True, bound=bound)
    want_q, want_scale = quantize_rows(out, bound)
    assert rows is not None and torch.equal(rows[1], want_scale) and (want_scale == bound / 448).any()
    assert torch.equal(rows[0].view(torch.uint8), want_q.view(torch.uint8))
    pool = (torch.randn(2, 64 * 16, 2, 16) * 8).to(torch.float8_e4m3fn)
    attn, merged = paged_decode_attention(torch.randn(2, 4, 16), pool,
                                          torch.tensor([[1, 2, 3, 0], [5, 6, 0, 0]], dtype=torch.int32),
                                          torch.tensor([40, 20], dtype=torch.int32), 16, splits=2,
                                          e4m3_rows=True, e4m3_bound=0.5)
    want_q, want_scale = quantize_rows(attn.reshape(2, -1), 0.5)
    assert merged is not None and torch.equal(merged[1], want_scale) and (want_scale == 0.5 / 448).any()
    assert torch.equal(merged[0].view(torch.uint8), want_q.view(torch.uint8))


if __name__ == "__main__":
    check_gemv()
    check_gemv_vector()
    check_silu_mul_quantize()
    check_norm_quantize()
    check_paged_decode()
    check_input_bound()
    print("fp8 kernels ok")
