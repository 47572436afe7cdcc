"""Prefills replayed as CUDA graph pieces (`engine.prefill_graphs`) against the same runner's eager
prefill: whole prompts and chunks after a cached prefix, padded to a bucket or filling one, bf16 and
FP8 weights. Skipped where there is no GPU."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (prefix, new tokens): whole prompts padded (5, 100) or filling their bucket (512), chunks after a prefix
CASES = [(0, 5), (0, 100), (0, 512), (1000, 64), (1000, 300), (3000, 512)]


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-7b", "qwen2.5-7b-fp8"])
def test_graphed_prefill_matches_eager(preset: str) -> None:
    from engine.offline import make_runner

    runner = make_runner(preset=preset, device="cuda:0", dtype=torch.bfloat16, max_model_len=4096, kv_gb=2.0,
                         cuda_graphs=True)
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.fits(512)
    pool, last = runner.pool, runner.config.num_layers - 1
    gen = torch.Generator().manual_seed(7)
    for prefix, new in CASES:
        tokens = torch.randint(0, 256, (prefix + new,), generator=gen).tolist()
        tables = [pool.allocator.allocate(pool.blocks_needed(prefix + new)) for _ in range(2)]
        done: list[int] = []
        if prefix:
            for table in tables:
                runner.prefill(tokens[:prefix], table, 0, graphed=False)
        eager = runner.prefill(tokens[prefix:], tables[0], prefix, graphed=False)
        graphed = runner.prefill(tokens[prefix:], tables[1], prefix, on_layer_done=done.append)
        kv = [pool.read(last, pool.slots(table, prefix, prefix + new)).float() for table in tables]
        for table in tables:
            pool.allocator.free(table)
        assert done == list(range(last + 1))
        # the padded rows change the matmuls' row count and so, at most, their rounding
        assert rel_err(graphed, eager) < 2e-2, (prefix, new)
        assert rel_err(kv[1], kv[0]) < 2e-2, (prefix, new)
        assert int(graphed.argmax()) == int(eager.argmax()), (prefix, new)


def test_prefill_graphs_without_decode_graphs_after_other_buckets() -> None:
    """The prefill server's runner: prefill graphs without the decode ones, buckets with split kernels (16
    and 64 rows) replayed after larger ones, each prefill as the eager one; the counts zero after."""
    from engine.kernels.arrivals import arrival_counts, capture_stream
    from engine.offline import make_runner

    runner = make_runner(preset="qwen2.5-7b", device="cuda:0", dtype=torch.bfloat16, max_model_len=2048,
                         kv_gb=1.0, max_batch_size=1, cuda_graphs=False, prefill_graphs=True)
    assert runner.graphs is None and runner.prefill_graphs is not None
    pool, gen = runner.pool, torch.Generator().manual_seed(5)
    for new in (300, 5, 100, 40, 512, 9):
        tokens = torch.randint(0, 256, (new,), generator=gen).tolist()
        tables = [pool.allocator.allocate(pool.blocks_needed(new)) for _ in range(2)]
        eager = runner.prefill(tokens, tables[0], 0, graphed=False)
        graphed = runner.prefill(tokens, tables[1], 0)
        for table in tables:
            pool.allocator.free(table)
        assert rel_err(graphed, eager) < 2e-2, new
        assert int(graphed.argmax()) == int(eager.argmax()), new
    with torch.cuda.stream(capture_stream(runner.device)):
        assert int(arrival_counts(runner.device).abs().sum()) == 0  # zero between kernels


def test_split_kernels_counts_stay_out_of_graph_pools() -> None:
    """A graph's temporary freed at the end of its capture goes back to the pool, where a later capture may
    take its block; replaying the first graph then writes over what the later one keeps there. Split
    kernels captured on `capture_stream` find their arrival counts made before any capture, out of every
    pool. Made in the first capture that needed them, they took a freed temporary's block: their zeroing
    ran only in that graph, and a split kernel in another graph, replayed after the temporary's, found
    the temporary's values and left its sums unwritten (the prefill server's graphs did this)."""
    from engine.kernels.arrivals import MAX_COUNTS, capture_stream
    from engine.kernels.gemv import GemvConfig, gemv

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(5, 1024, device=dev, generator=gen).to(torch.bfloat16)
    w = torch.randn(256, 1024, device=dev, generator=gen).to(torch.bfloat16)
    cfg = GemvConfig(32, 128, 4, 3, split_k=4)
    want = gemv(x, w, cfg=cfg)  # eager: compiled, and its own stream's counts
    stream, pool, out = capture_stream(dev), torch.cuda.graph_pool_handle(), {}
    graphs = {name: torch.cuda.CUDAGraph() for name in ("temporary", "first split", "second split")}
    with torch.cuda.graph(graphs["temporary"], pool=pool, stream=stream):
        temporary = torch.full((MAX_COUNTS,), 7, dtype=torch.int32, device=dev)
        out["temporary"] = temporary.sum()
        del temporary  # back to the pool at the capture's end
    for name in ("first split", "second split"):
        with torch.cuda.graph(graphs[name], pool=pool, stream=stream):
            out[name] = gemv(x, w, cfg=cfg)
    for name in ("first split", "second split", "first split"):  # each read before the pool's blocks are used again
        graphs["temporary"].replay()
        graphs[name].replay()
        assert torch.equal(out[name], want), name


def test_graphed_prefill_of_a_full_bucket_is_eagers_bits() -> None:
    """At a bucket's own row count the graphs run the eager prefill's kernels on the same shapes: a chunk after
    a cached prefix, and a whole prompt."""
    from engine.offline import make_runner

    runner = make_runner(preset="qwen2.5-7b", device="cuda:0", dtype=torch.bfloat16, max_model_len=2048,
                         kv_gb=1.0, cuda_graphs=True)
    tokens = torch.randint(0, 256, (1024 + 256,), generator=torch.Generator().manual_seed(3)).tolist()
    pool = runner.pool
    tables = [pool.allocator.allocate(pool.blocks_needed(len(tokens))) for _ in range(2)]
    for table in tables:
        runner.prefill(tokens[:1024], table, 0, graphed=False)
    eager = runner.prefill(tokens[1024:], tables[0], 1024, graphed=False)
    graphed = runner.prefill(tokens[1024:], tables[1], 1024)
    assert torch.equal(graphed, eager)
    whole = tokens[:512]  # a whole prompt: its attention graphed too, over the same 512 rows
    assert torch.equal(runner.prefill(whole, tables[1], 0), runner.prefill(whole, tables[0], 0, graphed=False))


def test_chunk_attention_on_grouped_heads_matches_repeated_heads() -> None:
    """A chunk after a cached prefix attends with flash on K and V's own heads (no copy a query head):
    the float32 reference on repeated heads and an explicit lower-right mask gives the same rows."""
    import torch.nn.functional as F

    from engine.attention import PrefillMeta, _flash_takes_grouped_heads, prefill_attention
    from engine.kv_cache import KVLayout, KVPool
    from engine.ops import expand_kv

    torch.manual_seed(2)
    dev = torch.device("cuda")
    pool = KVPool(KVLayout("m", "bfloat16", 1, 4, 128, 16), 512, dev, reserved_blocks=1)
    prefix, new = 3000, 300
    table = pool.allocator.allocate(pool.blocks_needed(prefix + new))
    kv = torch.randn(2, prefix + new, 4, 128, device=dev).to(torch.bfloat16)
    pool.write(0, pool.slots(table, 0, prefix + new), kv)
    q = torch.randn(new, 28, 128, device=dev).to(torch.bfloat16)
    meta = PrefillMeta(pool.slots(table, prefix, prefix + new), pool.slots(table, 0, prefix))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, kv[0], kv[1]))
    assert _flash_takes_grouped_heads(qh, kh, vh)
    out = prefill_attention(q, kv[0, prefix:], kv[1, prefix:], pool, 0, meta)
    seen = torch.arange(prefix + new, device=dev)[None, :] <= prefix + torch.arange(new, device=dev)[:, None]
    ref = F.scaled_dot_product_attention(qh.float(), expand_kv(kh.float(), 7), expand_kv(vh.float(), 7),
                                         attn_mask=seen).squeeze(0).transpose(0, 1)
    assert rel_err(out.float(), ref) < 1e-2
