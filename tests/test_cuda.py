"""The CUDA path: Triton kernels against the PyTorch reference, graphs against eager.
Skipped where there is no GPU; run on the device before GPU work is called done."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_paged_decode_kernel_matches_gather(kv_dtype: str) -> None:
    """The paged kernel against the gather path at every split count, at batches on both sides of
    CAPPED_FROM_BATCH (its tiles with fewer registers a thread from there on)."""
    from engine.attention import DecodeMeta, gather_decode_attention
    from engine.kernels.paged_decode import CAPPED_FROM_BATCH, paged_decode_attention
    from engine.kv_cache import KVLayout, KVPool

    torch.manual_seed(0)
    dev = torch.device("cuda")
    layout = KVLayout("m", kv_dtype, 1, 4, 128, 16)
    pool = KVPool(layout, 16384, dev, reserved_blocks=1)
    layer = pool.layers[0]
    layer.copy_(torch.randn(layer.shape, device=dev).to(layer.dtype))
    assert 17 < CAPPED_FROM_BATCH <= 40
    for batch in (1, 3, 17, 40, 64):
        lens = torch.randint(1, 3000, (batch,), dtype=torch.int32)
        tables = torch.zeros(batch, 200, dtype=torch.int32)
        owned = []
        for b in range(batch):
            blocks = pool.allocator.allocate(-(-int(lens[b]) // 16))
            owned.append(blocks)
            tables[b, :len(blocks)] = torch.tensor(blocks)
        q = torch.randn(batch, 28, 128, dtype=torch.bfloat16, device=dev)
        meta = DecodeMeta(torch.zeros(batch, dtype=torch.long, device=dev), tables.to(dev), lens.to(dev),
                          int(lens.max()))
        ref = gather_decode_attention(q.float(), _as_float(pool), 0, meta)
        for splits in (None, 1, 2, 64):  # the engine's choice; one slice, unmerged; most slices past the context
            out, _ = paged_decode_attention(q, pool.layers[0], meta.block_tables, meta.context_lens, 16, None, splits)
            assert rel_err(out, ref) < 1e-2
        for blocks in owned:
            pool.allocator.free(blocks)


def test_rotary_decode_attention_is_rope_then_attention() -> None:
    """The decode kernel that rotates q and k itself and writes the new K and V gives the bits of the
    rope kernel followed by the paged kernel, in the pool and in the result, at every split count;
    with the result's e4m3 rows written by its merge, the same pool and the quantization's bits."""
    from engine.kernels.fp8_quant import quantize_rows
    from engine.kernels.fused import rope_and_store
    from engine.kernels.paged_decode import paged_decode_attention, paged_decode_attention_rope
    from engine.kv_cache import KVLayout, KVPool
    from engine.model.decoder import RotaryTable

    dev = torch.device("cuda")
    heads, kv_heads, dim = 28, 4, 128
    rope = RotaryTable(dim, 1e6, 8192).to(dev)
    rope.reset()
    for batch, splits in ((1, None), (5, 1), (5, 4), (64, None)):
        torch.manual_seed(batch)
        pools = [KVPool(KVLayout("m", "bfloat16", 1, kv_heads, dim, 16), 16384, dev, reserved_blocks=1)
                 for _ in range(2)]
        pools[0].layers[0].normal_()
        pools[1].layers[0].copy_(pools[0].layers[0])
        lens = torch.randint(1, 3000, (batch,), dtype=torch.int32)
        tables = torch.zeros(batch, 200, dtype=torch.int32)
        for b in range(batch):
            blocks = pools[0].allocator.allocate(-(-int(lens[b]) // 16))
            pools[1].allocator.allocate(len(blocks))
            tables[b, :len(blocks)] = torch.tensor(blocks)
        pos = (lens - 1).long()
        slots = (tables[torch.arange(batch), pos // 16].long() * 16 + pos % 16).to(dev)
        pos, lens, tables = pos.to(dev), lens.to(dev), tables.to(dev)
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device=dev)
        q, _, _ = rope_and_store(qkv, pos, rope.cos, rope.sin, pools[0].layers[0], slots, heads, kv_heads, dim)
        want, _ = paged_decode_attention(q, pools[0].layers[0], tables, lens, 16, None, splits)
        got, none = paged_decode_attention_rope(qkv, heads, pos, rope.cos, rope.sin, slots, pools[1].layers[0],
                                                tables, lens, 16, None, splits)
        assert torch.equal(pools[0].layers[0], pools[1].layers[0])
        assert torch.equal(got, want) and none is None
        # the merge of a sequence's heads in one program, with the rows' e4m3 values for a W8A8 o_proj:
        # within a rounding of the merge by head, and `quantize_rows`' bits of its own result
        merged, rows = paged_decode_attention_rope(qkv, heads, pos, rope.cos, rope.sin, slots, pools[1].layers[0],
                                                   tables, lens, 16, None, splits, e4m3_rows=True)
        assert torch.equal(pools[0].layers[0], pools[1].layers[0])
        if splits == 1:
            assert rows is None and torch.equal(merged, want)
            continue
        assert rows is not None and torch.allclose(merged.float(), want.float(), rtol=2**-7, atol=1e-3), batch
        q8, scale = quantize_rows(merged.view(batch, -1))
        assert torch.equal(rows[1], scale) and torch.equal(rows[0].view(torch.uint8), q8.view(torch.uint8)), batch


def test_float32_decode_is_float32_at_the_7b_shape() -> None:
    """A float32 model on CUDA: the paged kernel's dots are exact float32 (not TF32), the skinny
    matmul leaves float32 to cuBLAS (its tiles overflow shared memory there), whole-prompt attention
    runs in bounded memory, and graphed decode runs and gives the eager path's tokens."""
    from engine.attention import DecodeMeta, gather_decode_attention
    from engine.kernels import gemv
    from engine.kernels.paged_decode import paged_decode_attention
    from engine.kv_cache import KVLayout, KVPool
    from engine.offline import generate, make_runner

    torch.manual_seed(1)
    dev = torch.device("cuda")
    pool = KVPool(KVLayout("m", "float32", 1, 4, 128, 16), 1024, dev, reserved_blocks=1)
    pool.layers[0].normal_()
    blocks = pool.allocator.allocate(125)
    meta = DecodeMeta(torch.zeros(2, dtype=torch.long, device=dev), torch.tensor([blocks, blocks], device=dev,
                      dtype=torch.int32), torch.tensor([2000, 1337], dtype=torch.int32, device=dev), 2000)
    q = torch.randn(2, 28, 128, device=dev)
    out, _ = paged_decode_attention(q, pool.layers[0], meta.block_tables, meta.context_lens, 16)
    assert rel_err(out, gather_decode_attention(q, pool, 0, meta)) < 1e-5  # TF32 dots give ~1e-3
    assert not gemv.supports(q[0], torch.empty(4608, 128, device=dev))

    from engine.attention import whole_prompt_attention

    torch.cuda.reset_peak_memory_stats()
    q, kv = torch.randn(16384, 28, 128, device=dev), torch.randn(16384, 4, 128, device=dev)
    whole_prompt_attention(q, kv, kv)
    assert torch.cuda.max_memory_allocated() < 4 * 2**30  # not the math path's [28, 16k, 16k] scores

    runner = make_runner(preset="qwen2.5-7b", device="cuda:0", dtype=torch.float32, max_batch_size=2,
                         max_model_len=256, kv_gb=1.0, cuda_graphs=True)
    prompts = [[(i * 11 + j) % 1000 for i in range(30 + 50 * j)] for j in range(2)]
    graphed = generate(runner, prompts, 6)
    runner.graphs = None
    assert generate(runner, prompts, 6) == graphed


def _as_float(pool):  # type: ignore[no-untyped-def]
    class View:
        layout = pool.layout
        layers = [t.float() for t in pool.layers]

    return View()


def test_fused_ops_match_pytorch() -> None:
    from engine import ops
    from engine.kernels import fused
    from engine.kernels.fp8_quant import quantize_rows
    from engine.model.decoder import RotaryTable

    torch.manual_seed(1)
    dev = torch.device("cuda")
    x = torch.randn(37, 3584, dtype=torch.bfloat16, device=dev)
    d = torch.randn_like(x)
    w = torch.randn(3584, dtype=torch.bfloat16, device=dev)
    ref_x = x.cpu() + d.cpu()
    ref, _ = ops.add_rms_norm(x.cpu(), w.cpu(), 1e-6, d.cpu())
    x_dev = x.clone()
    out, none = fused.add_rms_norm(x_dev, w, 1e-6, d)
    assert none is None and torch.equal(x_dev.cpu(), ref_x)
    assert rel_err(out.cpu(), ref) < 1e-2
    x_again = x.clone()  # the norm before a W8A8 projection: its output and that output's e4m3 rows
    out_again, e4m3 = fused.add_rms_norm(x_again, w, 1e-6, d, quantize=True)
    want_q, want_scale = quantize_rows(out)
    assert e4m3 is not None and torch.equal(out_again, out) and torch.equal(x_again, x_dev)
    assert torch.equal(e4m3[1], want_scale) and torch.equal(e4m3[0].view(torch.uint8), want_q.view(torch.uint8))
    gu = torch.randn(37, 2 * 1000, dtype=torch.bfloat16, device=dev)
    assert rel_err(fused.silu_mul(gu).cpu(), ops.silu_mul(gu.cpu())) < 1e-2
    rope = RotaryTable(128, 1e6, 4096)
    rope.reset()
    qkv = torch.randn(50, (28 + 8) * 128, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (50,))
    slots = torch.randperm(200)[:50]
    kv_ref = torch.zeros(2, 200, 4, 128, dtype=torch.bfloat16)
    q_ref, k_ref, _ = ops.rope_and_store(qkv, pos, rope.cos, rope.sin, kv_ref, slots, 28, 4, 128)
    kv = kv_ref.zero_().clone().to(dev)
    kv_ref2 = torch.zeros_like(kv_ref)
    ops.rope_and_store(qkv, pos, rope.cos, rope.sin, kv_ref2, slots, 28, 4, 128)
    q, k, _ = fused.rope_and_store(qkv.to(dev), pos.to(dev), rope.cos.to(dev), rope.sin.to(dev), kv, slots.to(dev),
                                   28, 4, 128)
    assert rel_err(q.cpu(), q_ref) < 1e-2 and rel_err(k.cpu(), k_ref) < 1e-2
    assert rel_err(kv.cpu(), kv_ref2) < 1e-2


def test_fed_embedding_takes_the_previous_steps_tokens_at_every_batch_size() -> None:
    """Rows with a source take previous[source]'s embedding, the rest their own id's, for the CUDA
    graphs' int32 metadata and the eager path's int64 rows alike."""
    from engine.kernels.fused import embed_fed

    dev = torch.device("cuda")
    weight = torch.randn(1300, 3584, dtype=torch.bfloat16, device=dev)
    previous = torch.arange(1000, 1300, dtype=torch.long, device=dev)
    for dtype in (torch.int32, torch.long):
        for n in (1, 2, 17, 300):
            ids = torch.full((n,), 7, dtype=dtype, device=dev)
            sources = torch.tensor([-1 if i % 3 == 0 else (i * 7) % 300 for i in range(n)], dtype=dtype, device=dev)
            want = torch.where(sources >= 0, previous[sources.clamp(min=0)].to(dtype), 7)
            assert torch.equal(embed_fed(ids, sources, previous, weight), weight[want.long()])


def test_fused_gate_up_silu_matches_cublas_then_silu_mul(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon GEMM with SiLU·mul in its epilogue gives the unfused path's values (cuBLAS gate/up,
    then the SiLU·mul kernel) bit for bit, on ragged row and column counts where TMA pads loads and
    clips stores; a prefill through it gives the unfused prefill's logits."""
    from engine import ops
    from engine.kernels import gate_up_silu as fused
    from engine.kernels.fused import silu_mul
    from engine.offline import make_runner

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused gate/up kernel is Hopper's")
    torch.manual_seed(4)
    dev = torch.device("cuda")
    w = (torch.randn(2 * 18944, 3584, device=dev) / 3584**0.5).bfloat16()
    for rows in (17, 300, 4096):
        x = torch.randn(rows, 3584, device=dev).bfloat16()
        assert fused.supports(x, w)
        assert torch.equal(fused.gate_up_silu(x, w), silu_mul(x @ w.t()))
    ragged = (torch.randn(2 * 1000, 512, device=dev) / 512**0.5).bfloat16()  # 1,000 = 7 tiles + 104 columns
    x = torch.randn(300, 512, device=dev).bfloat16()
    assert torch.equal(fused.gate_up_silu(x, ragged), silu_mul(x @ ragged.t()))
    calls: list[int] = []
    launch = fused.gate_up_silu

    def counted(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return launch(x, weight)

    monkeypatch.setattr(fused, "gate_up_silu", counted)
    length = ops.FUSED_GATE_UP_MIN_ROWS
    prompt = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = {}
    for on in (True, False):  # the same preset weights (seeded) built twice, with and without the kernel
        runner = make_runner(preset="qwen2.5-7b", device="cuda:0", dtype=torch.bfloat16, max_model_len=length + 64,
                             kv_gb=2.0, kernels=ops.KernelOptions(fused_gate_up=on))
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(length))
        logits[on] = runner.prefill(prompt, table, 0)
        assert len(calls) == runner.config.num_layers - 1  # the last layer's MLP sees one row; none when off
        del runner
    assert torch.equal(logits[False], logits[True])


def test_padded_rope_matches_unpadded() -> None:
    """The whole-prompt rope kernel's padded q, k, v hold the unpadded values, zeros after them, and
    write the same pool entries."""
    from engine.kernels import fused
    from engine.model.decoder import RotaryTable

    torch.manual_seed(4)
    dev = torch.device("cuda")
    rope = RotaryTable(128, 1e6, 8192)
    rope.to(dev).reset()
    tokens, rows = 1000, 1024
    qkv = torch.randn(tokens, (28 + 8) * 128, dtype=torch.bfloat16, device=dev)
    pos = torch.arange(tokens, device=dev) + 77
    slots = torch.randperm(3000, device=dev)[:tokens]
    kv_ref = torch.zeros(2, 3000, 4, 128, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros_like(kv_ref)
    q0, k0, v0 = fused.rope_and_store(qkv, pos, rope.cos, rope.sin, kv_ref, slots, 28, 4, 128)
    padded = fused.rope_and_store(qkv, pos, rope.cos, rope.sin, kv, slots, 28, 4, 128, rows)
    for got, want in zip(padded, (q0, k0, v0), strict=True):
        assert got.shape[0] == rows and torch.equal(got[:tokens], want)
        assert not got[tokens:].any()
    assert torch.equal(kv, kv_ref)


def test_tiled_rope_matches_per_token_rope() -> None:
    """Prefill-sized calls run the rope kernel on tiles of tokens (the last one partial), decode-sized
    calls a program per token: bit for bit the same q, k and pool entries."""
    from engine.kernels import fused
    from engine.model.decoder import RotaryTable

    torch.manual_seed(6)
    dev = torch.device("cuda")
    rope = RotaryTable(128, 1e6, 8192)
    rope.to(dev).reset()
    tokens = 1001
    qkv = torch.randn(tokens, (28 + 8) * 128, dtype=torch.bfloat16, device=dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    slots = torch.randperm(3000, device=dev)[:tokens]
    kv_tiled, kv_rows = (torch.zeros(2, 3000, 4, 128, dtype=torch.bfloat16, device=dev) for _ in range(2))
    q, k, _ = fused.rope_and_store(qkv, pos, rope.cos, rope.sin, kv_tiled, slots, 28, 4, 128)
    pieces = [fused.rope_and_store(qkv[i:i + 50], pos[i:i + 50], rope.cos, rope.sin, kv_rows, slots[i:i + 50],
                                   28, 4, 128) for i in range(0, tokens, 50)]
    assert torch.equal(q, torch.cat([p[0] for p in pieces])) and torch.equal(k, torch.cat([p[1] for p in pieces]))
    assert torch.equal(kv_tiled, kv_rows)


def test_padded_prefill_matches_unpadded() -> None:
    """cuDNN on a prompt padded to its bucket gives the real rows what it gives the bare prompt, to
    bf16 rounding (7B head shape)."""
    from engine.attention import attention_rows, whole_prompt_attention

    torch.manual_seed(5)
    dev = torch.device("cuda")
    tokens = 1000
    rows = attention_rows(tokens, dev)
    assert rows > tokens
    q = torch.randn(rows, 28, 128, dtype=torch.bfloat16, device=dev)
    k = torch.randn(rows, 4, 128, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    for t in (q, k, v):
        t[tokens:] = 0
    full = whole_prompt_attention(q, k, v)[:tokens]
    exact = whole_prompt_attention(q[:tokens].contiguous(), k[:tokens].contiguous(), v[:tokens].contiguous())
    assert (full.float() - exact.float()).abs().max() < 2e-2


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 24])  # 24: the skinny matmul's 64-row tile
def test_graph_tokens_equal_eager(batch: int) -> None:
    from engine.offline import generate, make_runner

    prompts = [[(i * 7 + j * 13) % 256 for i in range(20 + 15 * j)] for j in range(batch)]
    kwargs = dict(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_batch_size=max(8, batch),
                  max_model_len=1024)
    graphed = generate(make_runner(cuda_graphs=True, **kwargs), prompts, 40)  # type: ignore[arg-type]
    eager = generate(make_runner(cuda_graphs=False, **kwargs), prompts, 40)  # type: ignore[arg-type]
    assert graphed == eager


def test_graph_step_takes_its_tokens_from_any_previous_step() -> None:
    """A graph step whose rows take their tokens from the step before gets the eager path's logits,
    whichever that step was: a graph step on either side of buffers (fed inside the graph), a
    sampled copy of its tokens, or an eager step wider than the largest graph (both gathered first)."""
    from engine.decode_batch import DecodeSeq
    from engine.offline import make_runner

    kwargs = dict(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_batch_size=4, max_model_len=1024)
    graphed = make_runner(cuda_graphs=True, **kwargs)  # type: ignore[arg-type]
    eager = make_runner(cuda_graphs=False, **kwargs)  # type: ignore[arg-type]
    prompts = [[(i * 7 + j * 13) % 256 for i in range(20 + 15 * j)] for j in range(6)]
    results = []
    for runner in (graphed, eager):
        tables = [runner.pool.allocator.allocate(runner.pool.blocks_needed(len(p) + 8)) for p in prompts]
        for prompt, table in zip(prompts, tables, strict=True):
            runner.prefill(prompt, table, 0)
        pos = [len(p) for p in prompts]
        members = list(range(6))  # the sequence in each row of the last step
        logits, tokens = runner.decode([DecodeSeq(3, pos[j], tables[j]) for j in members])  # eager: 6 > 4
        steps = [logits]
        for picks, copy in (([5, 3, 0], False), ([2, 0, 1], False), ([1, 2], True), ([0, 1], False)):
            members = [members[row] for row in picks]
            for j in members:
                pos[j] += 1
            seqs = [DecodeSeq(0, pos[j], tables[j], row) for j, row in zip(members, picks, strict=True)]
            logits, tokens = runner.decode(seqs, tokens.clone() if copy else tokens)
            steps.append(logits)
        results.append([step.float().cpu() for step in steps])
        for table in tables:
            runner.pool.allocator.free(table)
    for graph_logits, eager_logits in zip(*results, strict=True):
        assert torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))
        assert (graph_logits - eager_logits).abs().max() < 5e-2


def test_programmatic_dependent_launch_changes_no_token() -> None:
    """Our kernels launched with PDL (each waits for the one before it) give the tokens of plain
    stream order, graphed and eager; on a GPU before Hopper both runs are plain."""
    from engine.kernels import launch
    from engine.offline import generate, make_runner
    from engine.ops import KernelOptions

    prompts = [[(i * 7 + j * 13) % 256 for i in range(20 + 15 * j)] for j in range(20)]
    kwargs = dict(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_batch_size=32, max_model_len=1024)
    try:
        runs = {pdl: [generate(make_runner(cuda_graphs=graphs, kernels=KernelOptions(pdl=pdl), **kwargs),  # type: ignore[arg-type]
                               prompts, 30) for graphs in (True, False)] for pdl in (True, False)}
    finally:
        launch.set_enabled(True)
    assert runs[True] == runs[False] and runs[True][0] == runs[True][1]


def test_batch_invariant_buckets() -> None:
    """With the smallest graph bucket at 8, a sequence's tokens don't depend on its batch-mates."""
    from engine.offline import generate, make_runner

    runner = make_runner(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_batch_size=8,
                         max_model_len=1024, cuda_graphs=True, min_decode_bucket=8)
    a = [(i * 5) % 256 for i in range(300)]
    others = [[(i * 3 + k) % 256 for i in range(100 + 40 * k)] for k in range(5)]
    alone = generate(runner, [a], 60)[0]
    assert generate(runner, [a, *others], 60)[0] == alone


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-7b"])
def test_chunked_prefill_matches_whole(preset: str) -> None:
    """Chunked prefill (attending over cached chunks) computes what one whole prefill does."""
    from engine.offline import make_runner

    runner = make_runner(preset=preset, device="cuda:0", dtype=torch.bfloat16, max_model_len=4200, kv_gb=2.0)
    prompt = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(3)).tolist()
    pool = runner.pool
    whole_table = pool.allocator.allocate(pool.blocks_needed(4096))
    chunk_table = pool.allocator.allocate(pool.blocks_needed(4096))
    whole = runner.prefill(prompt, whole_table, 0)
    for start in range(0, 4096, 512):
        chunked = runner.prefill(prompt[start:start + 512], chunk_table, start)
    top = torch.topk(whole, 2).values
    last = runner.config.num_layers - 1
    kv_whole = pool.read(last, pool.slots(whole_table, 0, 4096)).float()
    kv_chunk = pool.read(last, pool.slots(chunk_table, 0, 4096)).float()
    print(f"\n{preset}: logits rel err {rel_err(chunked, whole):.2e}, last layer KV rel err "
          f"{rel_err(kv_chunk, kv_whole):.2e}, top-2 margin {float(top[0] - top[1]):.4f} (logit std "
          f"{float(whole.std()):.3f}), argmax whole {int(whole.argmax())} chunked {int(chunked.argmax())}")
    # bf16 through 28 layers: different attention kernels (cuDNN whole, flash per chunk) round
    # differently; float32 agrees to 1e-6 (a real bug shows as O(1) error)
    assert rel_err(chunked, whole) < 5e-2
    assert rel_err(kv_chunk, kv_whole) < 5e-2


def test_skinny_decode_at_the_7b_shape() -> None:
    """At the real shape (where the skinny matmul runs): graph == eager tokens, and a step's
    logits agree with the cuBLAS path."""
    from engine import ops
    from engine.decode_batch import DecodeSeq
    from engine.offline import generate, make_runner
    from engine.runner import ModelRunner

    def one_step(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(100))
        runner.prefill(prompt, table, 0)
        return runner.decode([DecodeSeq(5, len(prompt), table)])[0]

    kwargs = dict(preset="qwen2.5-7b", device="cuda:0", dtype=torch.bfloat16, max_batch_size=4, max_model_len=512,
                  kv_gb=1.0)
    runner = make_runner(cuda_graphs=True, **kwargs)  # type: ignore[arg-type]
    prompts = [[(i * 7 + j * 13) % 1000 for i in range(40 + 30 * j)] for j in range(3)]
    graphed = generate(runner, prompts, 12)
    runner.graphs = None
    assert generate(runner, prompts, 12) == graphed
    skinny = one_step(runner, prompts[2])
    del runner
    # the same preset weights (seeded), built again with every matmul through cuBLAS
    cublas = one_step(make_runner(kernels=ops.KernelOptions(skinny_gemv=False), **kwargs),  # type: ignore[arg-type]
                      prompts[2])
    assert rel_err(skinny, cublas) < 2e-2


def test_token_reader_reads_what_tolist_reads() -> None:
    """The pinned read waits for the step that made the tokens, and grows past its capacity."""
    from engine.host_read import TokenReader

    dev = torch.device("cuda")
    reader = TokenReader(dev, capacity=4)
    for n in (1, 4, 9, 300):
        big = torch.randn(4096, 4096, device=dev)
        tokens = (big @ big).argmax(-1)[:n]  # still being computed when the read is queued
        assert reader.read(tokens) == tokens.tolist()
    assert reader.host.is_pinned() and reader.host.numel() >= 300


def test_layered_prefill_between_graph_steps_keeps_every_token() -> None:
    """A decodes (CUDA graphs) between the layer slices of B's prefill: each gets the tokens it
    gets alone."""
    import asyncio

    from decode_server.admission import Admission
    from decode_server.config import PrefillMode
    from decode_server.scheduler import BatchScheduler
    from decode_server.sequence import RequestSequence, TokenOutput
    from engine.offline import generate, make_runner
    from engine.sampling import SamplingParams

    runner = make_runner(preset="tiny", device="cuda:0", dtype=torch.bfloat16, max_batch_size=4,
                         max_model_len=8192, kv_gb=1.0, cuda_graphs=True)
    a_prompt = [(i * 7) % 256 for i in range(200)]
    b_prompt = [(i * 11 + 3) % 256 for i in range(8000)]
    a_alone, b_alone = generate(runner, [a_prompt], 40)[0], generate(runner, [b_prompt], 10)[0]
    loop = asyncio.new_event_loop()  # the outputs' readers' loop; the test reads them itself
    scheduler = BatchScheduler(runner, Admission(runner.pool, 16, 1 << 20, loop), max_batch_size=4,
                               layer_slice_tokens=8000)  # one layer a slice
    seqs: dict[str, RequestSequence] = {}

    def submit(name: str, tokens: list[int], new: int, mode: PrefillMode) -> None:
        seq = seqs[name] = RequestSequence(name, tokens, new, SamplingParams(), frozenset(), frozenset(), mode, 512)
        loop.run_until_complete(scheduler.admission.reserve(seq))
        scheduler.submit(seq)

    submit("a", a_prompt, 40, PrefillMode.COLOCATED)
    scheduler.step()
    submit("b", b_prompt, 10, PrefillMode.LAYERED)
    while (scheduler.running or scheduler.ready or scheduler.local.prefilling or scheduler.num_waiting
           or scheduler.step_in_flight):
        scheduler.step()
    loop.close()
    events = {name: [o.token_id for o in seq.out.taken() if isinstance(o, TokenOutput)] for name, seq in seqs.items()}
    assert events["a"] == a_alone
    assert events["b"] == b_alone
