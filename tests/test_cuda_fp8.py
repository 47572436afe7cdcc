"""FP8 weights on CUDA: the skinny matmul (plain, gated, argmax; MMA and CUDA-core tiles) and
`torch._scaled_mm` against the same e4m3 weights dequantized through the float32 reference; the FP8
preset in CUDA graphs against eager and against bf16; an FP8 checkpoint against its CPU reference.
Skipped where there is no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.conftest import rel_err, write_tiny_checkpoint

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPES = {"qkv": (4608, 3584, True), "o_proj": (3584, 3584, False), "gate_up": (37888, 3584, False),
          "down": (3584, 18944, False), "lm_head": (152064, 3584, False)}


def fp8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 row scales [N], the float32 values they stand for)."""
    from engine.fp8 import quantize_per_channel

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5 * torch.rand(n, 1, device="cuda", generator=g)
    q, scale = quantize_per_channel(w)
    return q, scale, q.float() * scale[:, None]


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 per row (largest magnitude to 448) and back, in float32: what a W8A8 tile sees."""
    from engine.fp8 import FP8, FP8_MAX

    x_scale = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
    return (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * x_scale


@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_skinny_matmul_is_the_dequantized_matmul(shape: str) -> None:
    """Every layer shape on the engine's tile at 1-2 rows (16-row tile) and at 3-64 (64-row tile,
    where it has one; else `torch._scaled_mm` runs): within bf16 rounding of x (quantized per row where
    the tile quantizes it) @ dequantized W^T in float32, and a row's result the same whatever rides
    along in its tile."""
    from engine.kernels.gemv import FP8_NARROW_ROWS, MAX_ROWS, WIDE_ROWS, config_for, gemv, tile_rows

    n, k, has_bias = SHAPES[shape]
    q, scale, ref_w = fp8_weight(n, k, seed=1)
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
    x = torch.randn(64, k, dtype=torch.bfloat16, device="cuda")
    assert config_for(q, FP8_NARROW_ROWS) is not None
    assert [tile_rows(q, m) for m in (1, 2, 3, 16, 64)] == [MAX_ROWS] * 2 + [WIDE_ROWS] * 3
    for rows in (FP8_NARROW_ROWS, WIDE_ROWS):
        cfg = config_for(q, rows)
        if cfg is None:
            continue
        full = gemv(x[:rows], q, bias, scale=scale)
        x_ref = quantized_rows(x[:rows]) if cfg.quantize_x else x[:rows].float()
        assert rel_err(full, F.linear(x_ref, ref_w, None if bias is None else bias.float())) < 1e-2, (shape, rows)
        for m in ((1,) if rows == FP8_NARROW_ROWS else (3, 5, 16, 17, 40, 63)):
            assert torch.equal(gemv(x[:m], q, bias, scale=scale), full[:m])
    logits = gemv(x[:2], q, bias, scale=scale, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, gemv(x[:2], q, bias, scale=scale).float())


def test_fp8_gated_and_argmax_epilogues() -> None:
    """SiLU·mul in the gate/up epilogue with each half's own scales; the lm_head's argmax over its
    FP8 logits is torch.argmax's (at 1-2 rows; from 3 an e4m3 lm_head takes torch._scaled_mm)."""
    from engine.kernels.gemv import gated_config_for, gemv, gemv_argmax, gemv_silu
    from engine.ops import silu_mul

    q, scale, ref_w = fp8_weight(37888, 3584, seed=2)
    for m in (1, 8, 16, 17, 64):
        cfg = gated_config_for(q, m)
        assert cfg is not None, m
        x = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
        want = silu_mul(F.linear(quantized_rows(x) if cfg.quantize_x else x.float(), ref_w).to(torch.bfloat16))
        assert rel_err(gemv_silu(x, q, scale=scale), want) < 2e-2, m
    q, scale, ref_w = fp8_weight(152064, 3584, seed=3)
    for m in (1, 2):
        x = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
        logits, tokens = gemv_argmax(x, q, out_dtype=torch.float32, scale=scale)
        assert torch.equal(logits, gemv(x, q, out_dtype=torch.float32, scale=scale))
        assert torch.equal(tokens, logits.argmax(-1))
        assert rel_err(logits, F.linear(x.float(), ref_w)) < 1e-2


@pytest.mark.parametrize("rows", [1, 16, 40, 64])
def test_fp8_w8a8_tiles_are_the_per_row_quantized_matmul(rows: int) -> None:
    """Tiles with `quantize_x` (x to e4m3 per row in the kernel on the 16-row tile, 1-2 rows; by
    `quantize_rows` first on the 64-row one, 3-64; FP8 tensor cores): plain, split-K and gated,
    against x quantized per row and the dequantized weights in float32; a row's result the same
    whatever rides along in its tile, and a column's the same on a strip narrower than its tile."""
    from dataclasses import replace

    from engine.kernels.gemv import GemvConfig, gemv, gemv_silu
    from engine.ops import silu_mul

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    block_n = 32 if rows <= 16 else 128
    for shape, split in (("qkv", 1), ("qkv", 2), ("down", 4), ("gate_up", 1)):
        n, k, has_bias = SHAPES[shape]
        q, scale, ref_w = fp8_weight(n, k, seed=5)
        bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        xq = quantized_rows(x)
        cfg = GemvConfig(block_n, 256 if rows <= 16 else 128, 4, 3, split, quantize_x=True)
        if shape == "gate_up":
            got = gemv_silu(x, q, GemvConfig(block_n // 2, cfg.block_k, 4, 3, 1, quantize_x=True), scale=scale)
            want = silu_mul(F.linear(xq, ref_w).to(torch.bfloat16))
        else:
            got = gemv(x, q, bias, cfg, scale=scale)
            want = F.linear(xq, ref_w, None if bias is None else bias.float())
        assert rel_err(got, want) < 1e-2, (shape, split)
        if shape != "gate_up":
            for m in ((3, 5) if rows == 16 else (17, 33) if rows == 64 else ()):
                assert torch.equal(gemv(x[:m], q, bias, cfg, scale=scale), got[:m]), (shape, m)
        if rows > 16:  # strips narrower than the tile (a program count that fits the SMs): the same bits
            narrow = replace(cfg, strip_n=100)
            if shape == "gate_up":
                tile = GemvConfig(block_n // 2, cfg.block_k, 4, 3, 1, quantize_x=True)
                assert torch.equal(gemv_silu(x, q, replace(tile, strip_n=48), scale=scale), got), shape
            else:
                assert torch.equal(gemv(x, q, bias, narrow, scale=scale), got), (shape, split)


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_float16_tiles_are_the_dequantized_matmul(rows: int) -> None:
    """Tiles with `f16_mma` (bf16 x and e4m3 weights multiplied in float16), on the tiles the sweep
    measured fastest: within bf16 rounding of x @ the dequantized W^T in float32, a row's result the
    same whatever rides along, and rows past float16's range scaled back to their bf16 result."""
    from engine.kernels.gemv import GemvConfig, gemv, gemv_silu
    from engine.ops import silu_mul

    for shape, cfg in (("down", GemvConfig(64, 256, 4, 4, 4, f16_mma=True)),
                       ("gate_up", GemvConfig(64, 128, 4, 3, 1, f16_mma=True))):
        n, k, _ = SHAPES[shape]
        q, scale, ref_w = fp8_weight(n, k, seed=7)
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        for factor in (1.0, 2.0**14):  # 2^14: past 65504 in float16 for |x| > 4
            xs = x * factor
            if shape == "gate_up":
                got = gemv_silu(xs, q, cfg, scale=scale)
                want = silu_mul(F.linear(xs.float(), ref_w).to(torch.bfloat16))
            else:
                got = gemv(xs, q, None, cfg, scale=scale)
                want = F.linear(xs.float(), ref_w)
            assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2, (shape, factor)
        if shape == "down" and rows == 16:  # the 64-row tile from 3 rows
            full = gemv(x, q, None, cfg, scale=scale)
            for m in (3, 5):
                assert torch.equal(gemv(x[:m], q, None, cfg, scale=scale), full[:m])


def test_fp8_cuda_core_tiles_are_the_dequantized_matmul() -> None:
    """The engine's CUDA-core tiles (1-2 rows, `engine.kernels.gemv_vector`) for every shape that has
    one: within bf16 rounding of x @ the dequantized W^T in float32 (SiLU·mul for gate/up, float32
    stores for logits), and a row's bits the same at 1 and 2 rows (two rows in one program)."""
    from engine.kernels.gemv_vector import VECTOR_ROWS, config_for, gemv_vector
    from engine.ops import silu_mul

    assert VECTOR_ROWS == 2
    for shape in ("qkv", "o_proj", "gate_up", "down"):
        n, k, has_bias = SHAPES[shape]
        q, scale, ref_w = fp8_weight(n, k, seed=11)
        bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
        x = torch.randn(VECTOR_ROWS, k, dtype=torch.bfloat16, device="cuda")
        gated = shape == "gate_up"
        cfg = config_for(x, q, gated=gated)
        assert cfg is not None and config_for(torch.cat([x, x[:1]]), q, gated=gated) is None, shape
        both = gemv_vector(x, q, scale, cfg, bias=bias, gated=gated)
        if gated:
            want = silu_mul(F.linear(x.float(), ref_w).to(torch.bfloat16))
        else:
            want = F.linear(x.float(), ref_w, None if bias is None else bias.float())
            logits = gemv_vector(x, q, scale, cfg, bias=bias, out_dtype=torch.float32)
            assert logits.dtype == torch.float32 and torch.equal(logits, both.float()), shape
        assert rel_err(both, want) < 1e-2, shape
        one = config_for(x[1:], q, gated=gated)
        assert one is not None and (cfg.block_m, one.block_m) == (2, 1), shape  # both rows in one program at two
        assert torch.equal(gemv_vector(x[1:], q, scale, one, bias=bias, gated=gated), both[1:]), shape


@pytest.mark.parametrize("rows", [17, 64, 65, 512, 4096])
def test_scaled_mm_prefill_is_the_per_token_quantized_matmul(rows: int) -> None:
    """Prefill's `torch._scaled_mm` path: x quantized per token, e4m3 weights, float32 sums; against the
    same quantized operands dequantized in float32, and near the unquantized activations' result."""
    from engine.fp8 import FP8, FP8_MAX, Fp8Linear, scaled_matmul, scaled_mm_supports

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    for n, k, has_bias in SHAPES.values():
        q, scale, ref_w = fp8_weight(n, k, seed=4)
        layer = Fp8Linear(k, n, has_bias, torch.bfloat16, torch.device("cuda"), keep_fp8=True, static_input=False)
        layer.set_rows(slice(None), q, scale)
        if layer.bias is not None:
            layer.bias.data.normal_()
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        assert scaled_mm_supports(x, layer)
        got = scaled_matmul(x, layer)
        x_scale = x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX
        xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * x_scale
        bias = None if layer.bias is None else layer.bias.float()
        assert rel_err(got, F.linear(xq, ref_w, bias)) < 1e-2
        assert rel_err(got, F.linear(x.float(), ref_w, bias)) < 6e-2  # the activations' own rounding


def test_fp8_preset_graphs_equal_eager_and_logits_near_bf16() -> None:
    """The 7B shape quantized at load: CUDA graphs (skinny FP8 matmuls, PDL, both sides of buffers)
    give eager's tokens; a prefill's logits against the bf16 preset's (the same seeded weights)."""
    from engine.decode_batch import DecodeSeq
    from engine.fp8 import Fp8Linear
    from engine.offline import generate, make_runner

    kwargs = dict(device="cuda:0", dtype=torch.bfloat16, max_batch_size=32, max_model_len=1024, kv_gb=2.0)
    runner = make_runner(preset="qwen2.5-7b-fp8", cuda_graphs=True, **kwargs)  # type: ignore[arg-type]
    assert isinstance(runner.model.layers[0].qkv, Fp8Linear) and runner.model.layers[0].qkv.weight.dtype.itemsize == 1
    prompts = [[(i * 7 + j * 13) % 1000 for i in range(40 + 30 * j)] for j in range(20)]
    graphed = generate(runner, prompts, 12)
    graphed_alone = generate(runner, prompts[:1], 12)  # one row: the CUDA-core tiles
    runner.graphs = None
    assert generate(runner, prompts, 12) == graphed
    assert generate(runner, prompts[:1], 12) == graphed_alone
    prompt = [(i * 31 + 5) % 5000 for i in range(600)]

    def last_logits(r: object) -> torch.Tensor:
        table = r.pool.allocator.allocate(r.pool.blocks_needed(700))  # type: ignore[attr-defined]
        logits = r.prefill(prompt, table, 0)  # type: ignore[attr-defined]
        step = r.decode([DecodeSeq(int(logits.argmax()), len(prompt), table)])[0][0]  # type: ignore[attr-defined]
        return torch.cat([logits.float(), step.float()])

    fp8 = last_logits(runner)
    del runner
    torch.cuda.empty_cache()
    bf16 = last_logits(make_runner(preset="qwen2.5-7b", **kwargs))  # type: ignore[arg-type]
    err = rel_err(fp8, bf16)
    print(f"\nqwen2.5-7b-fp8 against bf16: prefill + decode logits rel err {err:.3e}")
    assert err < 0.5  # reported; garbage (scales lost) is > 1


def _prefill_and_step(folder: Path, device: str, dtype: torch.dtype, prompts: list[list[int]],
                      tokens: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    """Each prompt's prefill logits and one decode step of all of them together (each fed `tokens`, the
    reference's first tokens, where given), in float32 [2 B, vocab]; and the first tokens."""
    from engine.decode_batch import DecodeSeq
    from engine.offline import make_runner

    runner = make_runner(model=str(folder), device=device, dtype=dtype, max_model_len=256)
    tables = [runner.pool.allocator.allocate(runner.pool.blocks_needed(100)) for _ in prompts]
    firsts = torch.stack([runner.prefill(p, t, 0).float().cpu().reshape(-1) for p, t in zip(prompts, tables,
                                                                                             strict=True)])
    tokens = tokens or firsts.argmax(-1).tolist()
    step = runner.decode([DecodeSeq(tok, len(p), t) for tok, p, t in zip(tokens, prompts, tables, strict=True)])[0]
    return torch.cat([firsts, step.float().cpu()]), tokens


@pytest.mark.e2e
@pytest.mark.parametrize("export", ["hf-fp8", "modelopt-FP8", "modelopt-FP8-clipping"])
def test_fp8_checkpoint_on_cuda_matches_its_cpu_reference(export: str, tmp_path: Path) -> None:
    """A tiny FP8 checkpoint, HF block-FP8 or ModelOpt's FP8 (per-tensor scales, static input scales): on
    CUDA (requantized per channel, FP8 matmuls) its prefill and first decode step's logits are those of
    the CPU reference path (dequantized at load, float32) to FP8 and bf16 rounding: the prefill's
    activations quantized per token (or by the static scales), the block scales folded into row scales.
    Both decode steps take the reference's token, so a flipped argmax does not change the input.
    How far bf16 alone moves the logits depends on the checkpoint: static scales that clip (2-2.8 here,
    27-31% of the down projections' inputs) cut those inputs' norm far more than the difference the
    layers before carried, so the CPU reference run in bf16 departs from itself in float32 by 0.38 where
    scales that clip nothing give 0.14 (bench/NOTES.md). The bound is that distance with a margin: CUDA
    is no further from the reference than the reference's own bf16 run, and scales lost would be > 1."""
    from tests.test_fp8_loading import write_fp8
    from tests.test_fp8_modelopt import write_modelopt

    base = write_tiny_checkpoint(tmp_path / "base", seed=7, family="qwen3", hidden_size=256, intermediate_size=512)
    if export == "hf-fp8":
        folder, _ = write_fp8(base, tmp_path / "fp8", "hf-fp8")
    else:
        folder = write_modelopt(base, tmp_path / "fp8", "FP8", legacy=False)
        if not export.endswith("-clipping"):  # scales wide enough that no activation clips
            weights = load_file(folder / "model.safetensors")
            save_file({name: torch.full_like(t, 100.0 / 448) if name.endswith("input_scale") else t
                       for name, t in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    prompts = [[(i * 37 + 11) % 290 for i in range(70)]]
    reference, tokens = _prefill_and_step(folder, "cpu", torch.float32, prompts, None)  # fed to every decode step
    in_bf16, _ = _prefill_and_step(folder, "cpu", torch.bfloat16, prompts, tokens)
    cuda, _ = _prefill_and_step(folder, "cuda:0", torch.bfloat16, prompts, tokens)
    err, own = rel_err(cuda, reference), rel_err(in_bf16, reference)
    print(f"\n{export} tiny checkpoint, logits rel err against the float32 reference: CUDA {err:.3e}, "
          f"the reference in bf16 {own:.3e}")
    # bf16 alone is 2e-2 on this tiny random model, prefill's per-token e4m3 activations 0.07-0.10 (a
    # float32 emulation on the CPU); the block-FP8 case measured 0.161 on an H200
    assert err < max(0.25, 1.5 * own)


@pytest.mark.e2e
@pytest.mark.parametrize("batch", [1, 3, 20])
def test_fbgemm_input_bound_holds_in_every_cuda_path(batch: int, tmp_path: Path) -> None:
    """An fbgemm_fp8 checkpoint whose `activation_scale_ub` clips its projections' inputs: on CUDA (prefill
    on `torch._scaled_mm` with the bounded per-token quantization and SiLU·mul's; a decode step of one
    row on the 16-bit-x tiles, which clamp x; of 3 and 20 rows on the 64-row W8A8 tiles, which take the
    norm's, the attention merge's and `quantize_rows`' bounded e4m3 rows) the logits are the CPU
    reference's (inputs clamped to the bound) to FP8 and bf16 rounding, and far from the same weights
    unbounded."""
    from tests.test_fp8_fbgemm import write_fbgemm

    base = write_tiny_checkpoint(tmp_path / "base", seed=7, family="llama", hidden_size=256, intermediate_size=512)
    bounded = write_fbgemm(base, tmp_path / "bounded")
    unbounded = write_fbgemm(base, tmp_path / "unbounded", bound=None)  # 1200: never reached here
    prompts = [[(i * 37 + 11 * j) % 290 for i in range(40 + j)] for j in range(batch)]
    reference, tokens = _prefill_and_step(bounded, "cpu", torch.float32, prompts, None)
    own, _ = _prefill_and_step(bounded, "cpu", torch.bfloat16, prompts, tokens)
    free, _ = _prefill_and_step(unbounded, "cpu", torch.float32, prompts, tokens)
    cuda, _ = _prefill_and_step(bounded, "cuda:0", torch.bfloat16, prompts, tokens)
    err, own_err, bound_effect = rel_err(cuda, reference), rel_err(own, reference), rel_err(free, reference)
    print(f"\nfbgemm, batch {batch}: CUDA {err:.3e} from the bounded reference, its bf16 run {own_err:.3e}, "
          f"the unbounded weights {bound_effect:.3e}")
    assert bound_effect > 0.5 and err < max(0.25, 1.5 * own_err) and err < bound_effect / 2


@pytest.mark.parametrize("columns", [18944, 40000])  # a row held whole; one past MAX_WHOLE_ROW, in two passes
def test_per_token_quantization_kernel_is_the_pytorch_one(columns: int) -> None:
    """The activation quantization (one kernel) against the same steps in PyTorch: equal scales,
    values within one e4m3 rounding, an all-zero row kept finite."""
    from engine.fp8 import FP8, FP8_MAX
    from engine.kernels.fp8_quant import MAX_WHOLE_ROW, quantize_rows

    assert (columns > MAX_WHOLE_ROW) == (columns == 40000)
    x = torch.randn(300, columns, dtype=torch.bfloat16, device="cuda") * torch.rand(300, 1, device="cuda").bfloat16()
    x[7] = 0
    q, scale = quantize_rows(x)
    want_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    assert q.dtype == FP8 and torch.allclose(scale, want_scale, rtol=1e-6, atol=0)
    want = (x.float() / want_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    assert (q.float() != want).float().mean() < 1e-3 and rel_err(q.float() * scale, x.float()) < 4e-2
    assert torch.equal(q[7].float(), torch.zeros(columns, device="cuda"))


@pytest.mark.parametrize("rows", [2, 3, 16, 64, 65, 300])
def test_norm_written_e4m3_rows_give_the_projections_bits(rows: int) -> None:
    """From 3 rows the norm before qkv and before gate/up writes its output's e4m3 rows (the bits
    `quantize_rows` writes), and the W8A8 tile (3-64 rows) or `torch._scaled_mm` (above) takes them:
    each projection's output, and the MLP's, is the same bits as after the plain norm. At 1-2 rows
    the norm writes none."""
    from engine import ops
    from engine.fp8 import Fp8Linear, quantize_per_channel

    dev = torch.device("cuda")
    qkv, gate_up = (Fp8Linear(512, n, bias=bias, dtype=torch.bfloat16, device=dev, keep_fp8=True, static_input=False)
                    for n, bias in ((1024, True), (2 * 1024, False)))
    for layer in (qkv, gate_up):
        layer.set_rows(slice(None), *quantize_per_channel(torch.randn(layer.weight.shape, device=dev) * 512**-0.5))
    if qkv.bias is not None:
        qkv.bias.normal_()
    x, delta = (torch.randn(rows, 512, dtype=torch.bfloat16, device=dev) for _ in range(2))
    weight = torch.rand(512, dtype=torch.bfloat16, device=dev) * 2
    kernels = ops.ALL_KERNELS
    for layer, gated in ((qkv, False), (gate_up, True)):
        project = ops.gate_up_silu if gated else ops.linear
        plain, x_plain = ops.add_rms_norm(x.clone(), weight, 1e-6, delta)
        fed, x_fed = ops.norm_feeding(x.clone(), weight, 1e-6, delta, layer, kernels, gated)
        assert isinstance(fed, ops.QuantizedRows) == (rows > 2), rows
        assert torch.equal(x_fed, x_plain)
        assert torch.equal(project(fed, layer, kernels), project(plain, layer, kernels)), (rows, gated)
    down = Fp8Linear(1024, 512, bias=False, dtype=torch.bfloat16, device=dev, keep_fp8=True, static_input=False)
    down.set_rows(slice(None), *quantize_per_channel(torch.randn(down.weight.shape, device=dev) * 1024**-0.5))
    fed, _ = ops.norm_feeding(x.clone(), weight, 1e-6, delta, gate_up, kernels, gated=True)
    plain, _ = ops.add_rms_norm(x.clone(), weight, 1e-6, delta)
    assert torch.equal(ops.mlp(fed, gate_up, down, kernels), ops.mlp(plain, gate_up, down, kernels))


def test_silu_mul_quantization_is_silu_mul_then_quantization() -> None:
    """The FP8 prefill's down-projection input: SiLU·mul and its per-token quantization in one
    kernel give the bits of the two kernels in turn; the layer's MLP through it, the unfused path's."""
    from engine import ops
    from engine.fp8 import Fp8Linear, quantize_per_channel
    from engine.kernels.fp8_quant import quantize_rows, silu_mul_quantize_rows
    from engine.kernels.fused import silu_mul

    gu = torch.randn(300, 2 * 18944, dtype=torch.bfloat16, device="cuda") * 4
    gu[5] = 0
    want_q, want_scale = quantize_rows(silu_mul(gu))
    for programs in (None, 7):  # a row a program; 7 programs taking 42-43 rows each
        q, scale = silu_mul_quantize_rows(gu, programs=programs)
        assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    layers = []
    for n, k in ((2 * 1024, 512), (512, 1024)):
        layer = Fp8Linear(k, n, bias=False, dtype=torch.bfloat16, device=torch.device("cuda"), keep_fp8=True,
                          static_input=False)
        layer.set_rows(slice(None), *quantize_per_channel(torch.randn(n, k, device="cuda") * k**-0.5))
        layers.append(layer)
    x = torch.randn(200, 512, dtype=torch.bfloat16, device="cuda")
    unfused = ops.linear(ops.gate_up_silu(x, layers[0], ops.ALL_KERNELS), layers[1], ops.ALL_KERNELS)
    assert torch.equal(ops.mlp(x, layers[0], layers[1], ops.ALL_KERNELS), unfused)


def test_fp8_kv_paged_kernel_reads_what_the_gather_path_reads() -> None:
    """An e4m3 pool on CUDA: the Triton paged decode kernel (which writes the new token's K and V
    rounded, then reads the pool) gives the gather path's logits; CUDA graphs give eager's tokens."""
    from engine.decode_batch import DecodeSeq
    from engine.offline import generate, make_runner

    kwargs = dict(preset="tiny", device="cuda:0", dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                  max_batch_size=8, max_model_len=1024)
    runner = make_runner(**kwargs)  # type: ignore[arg-type]
    assert runner.pool.storage.dtype == torch.float8_e4m3fn
    prompt = [(i * 7 + 3) % 256 for i in range(300)]
    table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(prompt) + 1))
    runner.prefill(prompt, table, 0)
    logits = {}
    for kernel in (True, False):  # the same step twice: the new token's slot rewritten with the same bytes
        runner.use_kernel = kernel
        logits[kernel] = runner.decode([DecodeSeq(42, len(prompt), table)])[0][0]
    assert rel_err(logits[True], logits[False]) < 2e-2  # 1.0e-2 measured on an H200: e4m3 keeps 3 mantissa bits
    prompts = [[(i * 7 + j * 13) % 256 for i in range(40 + 30 * j)] for j in range(6)]
    graphed = generate(make_runner(cuda_graphs=True, **kwargs), prompts, 24)  # type: ignore[arg-type]
    assert generate(make_runner(cuda_graphs=False, **kwargs), prompts, 24) == graphed  # type: ignore[arg-type]


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["nccl", "cuda-ipc", "grpc"])
def test_fp8_kv_crosses_every_transport_at_one_byte(transport: str, server_logs: Path) -> None:
    """Both servers with --kv-cache-dtype fp8: one byte a value on the wire (the handoff's kv_bytes),
    checksummed on both sides, and the tokens of a colocated server with the same e4m3 pool."""
    from pd.v1 import decode_pb2

    from tests.servers import ServerProcess
    from tests.test_cuda_transport import GPUS, generate, needs

    needs(transport)
    common = ["--preset", "tiny", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8", "--kv-transport", transport,
              "--kv-cache-gb", "1"]
    prefill = ServerProcess("prefill_server", common, server_logs, device="cuda:0").start(timeout=300)
    decode = ServerProcess("decode_server", [*common, "--prefill-addr", prefill.address, "--kv-checksum", "on"],
                           server_logs, device=f"cuda:{min(1, GPUS - 1)}").start(timeout=300)
    reference = ServerProcess("decode_server", [*common, "--mode", "colocated"], server_logs,
                              device="cuda:0").start(timeout=300)
    try:
        import grpc
        from pd.v1 import decode_pb2_grpc

        prompt = [(i * 7 + 3) % 256 for i in range(700)]
        with grpc.insecure_channel(decode.address) as ch:
            replies = list(decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                token_ids=prompt, max_new_tokens=20, ignore_eos=True,
                prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=120))
        assert replies[-1].timing.kv_bytes == len(prompt) * 4 * 2 * 2 * 16  # layers, K and V, heads, dim: 1 byte
        assert [r.token_id for r in replies] == generate(reference.address, prompt,
                                                          decode_pb2.PREFILL_MODE_COLOCATED, 20)
    finally:
        for server in (reference, decode, prefill):
            server.stop()


def test_fp8_kv_stores_round_as_pytorch_does() -> None:
    """The prefill's rope-and-store kernel and the decode kernel write into an e4m3 pool the bytes
    PyTorch's rounding (saturating at 448) gives for the 16-bit pool's values."""
    from engine.kernels import fused
    from engine.kernels.paged_decode import paged_decode_attention_rope
    from engine.kv_cache import to_kv_dtype
    from engine.model.decoder import RotaryTable

    heads, kv_heads, dim, tokens = 8, 2, 128, 300
    rope = RotaryTable(dim, 1e6, 1024)
    rope.to("cuda").reset()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda") * 150
    positions = torch.arange(tokens, device="cuda")
    slots = torch.arange(tokens, device="cuda") + 16
    pools = {dt: torch.zeros(2, 1024, kv_heads, dim, dtype=dt, device="cuda")
             for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    for pool in pools.values():
        fused.rope_and_store(qkv, positions, rope.cos, rope.sin, pool, slots, heads, kv_heads, dim)
    want = to_kv_dtype(pools[torch.bfloat16], torch.float8_e4m3fn)
    assert (pools[torch.bfloat16].abs() > 448).any()  # saturation is exercised
    assert torch.equal(pools[torch.float8_e4m3fn].view(torch.uint8), want.view(torch.uint8))
    tables = torch.arange(1, 21, dtype=torch.int32, device="cuda")[None]  # one sequence, slots 16-335
    lens = torch.tensor([tokens + 1], dtype=torch.int32, device="cuda")
    new = torch.tensor([tokens + 16], device="cuda")
    for pool in pools.values():
        paged_decode_attention_rope(qkv[:1], heads, positions[-1:] + 1, rope.cos, rope.sin, new, pool, tables, lens, 16)
    want = to_kv_dtype(pools[torch.bfloat16][:, new], torch.float8_e4m3fn)
    assert torch.equal(pools[torch.float8_e4m3fn][:, new].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(300, 28, 4, 128), (1000, 8, 8, 64)])
def test_fp8_prefill_attention_is_the_e4m3_attention(tokens: int, heads: int, kv_heads: int, dim: int) -> None:
    """cuDNN's FP8 attention (an e4m3 pool's whole-prompt prefill) against float32 attention over the
    e4m3 values it is given (q with its scale, k and v as the pool rounds them: saturated past 448), and
    near the bf16 route; zero rows after the prompt (the padded length bucket) leave the prompt's rows
    as they were."""
    from engine.attention import attention_rows, whole_prompt_attention
    from engine.attention_fp8 import fp8_causal_attention, quantize_q
    from engine.kv_cache import to_kv_dtype

    g = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, v = (torch.randn(tokens, h, dim, device="cuda", generator=g).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    got = fp8_causal_attention(q, k, v)
    err = rel_err(got.float(), whole_prompt_attention(q, k, v).float())
    assert err < 8e-2, err  # 5.5% measured on an H200 at Qwen2.5-7B's shape: q, k, v, P and O in e4m3
    q, k, v = q * 3, k * 3, v * 3
    k[:, :, 0] += 600
    got = fp8_causal_attention(q, k, v)
    q8, descale = quantize_q(q)
    e4m3 = [q8.float() * descale.flatten()] + [to_kv_dtype(t, torch.float8_e4m3fn).float() for t in (k, v)]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in e4m3)
    want = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    err = rel_err(got.float(), want)
    assert err < 6e-2, err  # the probabilities' and the output's own e4m3 rounding
    rows = attention_rows(tokens + 1, q.device) + 16
    padded = [torch.cat((t, t.new_zeros(rows - tokens, *t.shape[1:]))) for t in (q, k, v)]
    err = rel_err(fp8_causal_attention(*padded)[:tokens].float(), got.float())
    assert err < 1e-2, err  # another shape may take another kernel: the same values up to its rounding


def test_fp8_pool_prefills_through_fp8_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """An e4m3 pool on a Hopper GPU sends whole prompts of at least `MIN_ROWS` rows through FP8 attention
    (here every prompt); a prompt's logits stay near those of the same pool with 16-bit attention."""
    from engine import attention, attention_fp8
    from engine.offline import make_runner

    if not attention_fp8.available(torch.device("cuda:0")):
        pytest.skip("FP8 attention needs Hopper and cudnn-frontend")
    monkeypatch.setattr(attention_fp8, "MIN_ROWS", 0)
    runner = make_runner(preset="tiny", device="cuda:0", dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                         max_batch_size=8, max_model_len=1024)
    prompt = [(i * 7 + 3) % 256 for i in range(300)]
    table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(prompt)))
    calls: list[int] = []
    real = attention_fp8.fp8_causal_attention

    def counted(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(attention_fp8, "fp8_causal_attention", counted)
    fp8 = runner.prefill(prompt, table, 0)
    assert calls
    monkeypatch.setattr(attention, "fp8_prefill", lambda pool, device: False)
    err = rel_err(fp8, runner.prefill(prompt, table, 0))
    assert err < 3e-2, err
