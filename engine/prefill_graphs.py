"""Short prefills replayed as CUDA graphs: one graph for each stretch between two attentions, and a whole
prompt's attention.

A prefill of a few hundred tokens is bound by the host when it runs eagerly: each of a 7B's 28 layers
queues about twenty kernels (norms, projections, rope and the KV write, the MLP), and Python and their
launches take about 1 ms a layer where the GPU needs 0.4 at 512 tokens (`bench/NOTES.md`). Here a
prefill of up to `BUCKETS[-1]` tokens replays one graph a layer: piece 0 is the embedding and layer
0 up to its KV write; piece i is layer i-1's o_proj, norm and MLP, then layer i up to its KV write.
A whole prompt's attention between them is one more graph a bucket: its keys are its own rows, padded
to the bucket, and every layer's reads the same q/k/v buffers. A chunk's after a cached prefix stays
eager, since its key length (the prefix) changes from one prefill to the next; so does the last layer
after its KV write, which carries only the last row on, as the eager forward does. The attention
graphs keep their temporaries in a memory pool of their own: replayed between two pieces, in the
pieces' pool they could take the block of a residual one piece hands the next.

A prefill's rows are padded to a bucket: padding rows take token 0 at position 0, write their KV into
the pool's reserved block 0, which nobody reads, and no real row attends to them (they come after
every real row, and attention is causal). One prefill runs at a time: the graphs share their input,
q/k/v and attention buffers, so only the thread that owns them may replay them. The engine thread owns
one set; partitioned mode's prefill thread captures its own on its green context's stream
(`ModelRunner.partition_graphs`), where their kernels keep to that context's SMs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention import PrefillMeta, whole_prompt_attention
from engine.cuda_graphs import capture
from engine.kv_cache import KVPool, slot_ids
from engine.model import DecoderModel
from engine.model.decoder import DecoderLayer

log = logging.getLogger(__name__)

# Row buckets. Above 512 rows a 7B's prefill is bound by the GPU even when eager (a 512-token chunk
# after a short prefix: about 13 ms of GPU work against 30 of host work, `bench/NOTES.md`). 448 keeps
# turns of 385-448 tokens from paying for 512 rows of GPU work, which graphed such a turn is bound by.
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 448, 512)
# A partition's set stops at 384: on 72 SMs of one H200 a turn's GPU work at 448 rows already took longer
# (18.6 ms) than its eager run's launches (18.0), and a short turn's 7.3 against 17.4 (`bench/NOTES.md`)
PARTITION_BUCKETS = BUCKETS[:BUCKETS.index(384) + 1]


class PrefillGraphs:
    """Prefills of up to `buckets[-1]` tokens of `model` over `pool` as graphed pieces, with a whole
    prompt's attention graphed and a chunk's eager. `capture=False` runs the same work eagerly (the CPU,
    and tests of the padding). `stream`: where the graphs are captured and replayed, when not the
    engine thread's (`engine.cuda_graphs.capture`); the pinned input buffer is then reused once that
    stream has done all it was given, not after an event, which would cross from it to another."""

    def __init__(self, model: DecoderModel, pool: KVPool, buckets: Sequence[int] = BUCKETS,
                 capture: bool = True, stream: torch.cuda.Stream | None = None) -> None:
        self.model, self.pool, self.buckets, self.stream = model, pool, tuple(buckets), stream
        self.layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        cfg, n, device = model.config, self.buckets[-1], pool.device
        dtype = model.embed.weight.dtype
        with torch.inference_mode():
            # ids, positions and new slots, one upload from pinned memory a prefill
            self.inputs = torch.zeros(3 * n, dtype=torch.long, device=device)
            self.inputs_host = torch.zeros(3 * n, dtype=torch.long, pin_memory=device.type == "cuda")
            self.ids, self.positions, self.slots = self.inputs.view(3, n).unbind(0)
            self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
            self.k = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)
            self.attn = torch.zeros(n, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        # the pinned buffer is free once this is reached (on the engine thread's stream)
        self.uploaded = torch.cuda.Event() if device.type == "cuda" and stream is None else None
        self.x: dict[int, torch.Tensor] = {}  # each bucket's residual stream, as its last piece leaves it
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.attend: dict[int, Callable[[], None]] = {}  # a whole prompt's attention, q/k/v -> attn
        self.replays = 0  # prefills replayed (the tests' witness that a path took the graphs)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        started = time.perf_counter()
        graph_pool = torch.cuda.graph_pool_handle() if capture else None
        attention_pool = torch.cuda.graph_pool_handle() if capture else None
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self.pieces[b] = [self._graphed(functools.partial(self._piece, b, i), graph_pool, b)
                              for i in range(len(self.layers))]
            self.attend[b] = self._graphed(functools.partial(self._attend, b), attention_pool)
        if capture:
            log.info("captured %d prefill CUDA graphs (%d a prompt, buckets %s) in %.1fs",
                     len(self.buckets) * (len(model.layers) + 1), len(model.layers) + 1, list(self.buckets),
                     time.perf_counter() - started)

    def fits(self, tokens: int) -> bool:
        return bool(self.pieces) and 0 < tokens <= self.buckets[-1]

    def release(self) -> None:
        """Free the graphs now: a set captured on a green context's stream must go before that context does
        (destroyed after it, a graph's executable fails and takes the process down)."""
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.pieces.clear()
        self.attend.clear()

    def _piece(self, b: int, i: int) -> None:
        """Layer i-1 after its attention (none for i = 0: the embedding), then layer i up to its KV write,
        over `b` rows; q, k and v go to the shared buffers."""
        layers = self.layers
        with torch.inference_mode():
            if i == 0:
                x, delta = self.model.embed(self.ids[:b]), None
            else:
                x, delta = layers[i - 1].after_attention(self.x[b], self.attn[:b])
            qkv, self.x[b] = layers[i].project_qkv(x, delta)
            q, k, v = layers[i].rope_and_store(qkv, self.positions[:b], self.model.rope, self.pool, i,
                                               self.slots[:b], None)
            self.q[:b].copy_(q)
            self.k[:b].copy_(k)
            self.v[:b].copy_(v)

    def _attend(self, b: int) -> None:
        """A whole prompt's attention over the bucket's rows (the padding rows come after every real one)."""
        with torch.inference_mode():
            heads = whole_prompt_attention(self.q[:b], self.k[:b], self.v[:b])
            self.attn[:b].view_as(heads).copy_(heads)

    def _graphed(self, work: Callable[[], None], graph_pool: tuple[int, int] | None,
                 b: int | None = None) -> Callable[[], None]:
        """`work`'s graph in `graph_pool` to replay, or `work` itself where nothing is captured. A piece of
        bucket `b` replaces its residual, and its graph must read the one the earlier pieces' graphs
        write: the warm-up runs put that one back."""
        if graph_pool is None:
            return work
        settle = None
        if b is not None and (residual := self.x.get(b)) is not None:
            settle = functools.partial(self.x.__setitem__, b, residual)
        graph = capture(work, self.pool.device, graph_pool, settle, self.stream)
        self.graphs.append(graph)
        return graph.replay

    def bucket_for(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int] | np.ndarray, block_table: list[int], start: int,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """`engine.runner.ModelRunner.prefill` of `token_ids` (at most `buckets[-1]`) as positions
        start.. of the sequence: the last token's float32 logits [1, V]."""
        if self.stream is not None and torch.cuda.current_stream(self.pool.device) != self.stream:
            raise RuntimeError("these prefill graphs replay on the stream they were captured on")
        t = len(token_ids)
        b = self.bucket_for(t)
        self.replays += 1
        meta = self._upload(token_ids, block_table, start, b)
        layers = self.layers
        last = len(layers) - 1
        q, k, v = self.q[:t], self.k[:t], self.v[:t]
        for i, piece in enumerate(self.pieces[b]):
            piece()
            if i == last:
                break
            if meta.whole_prompt:
                self.attend[b]()
            else:
                heads, _ = layers[i].prefill_attention(q, k, v, self.x[b], self.pool, i, meta, False)
                self.attn[:t].view_as(heads).copy_(heads)
            if on_layer_done is not None:
                on_layer_done(i)
        heads, x = layers[last].prefill_attention(q, k, v, self.x[b], self.pool, last, meta, True)
        x, delta = layers[last].after_attention(x, heads.reshape(1, -1))
        if on_layer_done is not None:
            on_layer_done(last)
        return self.model.logits(x, delta)

    def _upload(self, token_ids: Sequence[int] | np.ndarray, block_table: list[int], start: int,
                b: int) -> PrefillMeta:
        """The prefill's ids, positions and slots into the shared input buffer, padding rows after them."""
        t, n = len(token_ids), self.buckets[-1]
        if self.uploaded is not None:
            self.uploaded.synchronize()  # at once in practice: the last prefill's upload is long done
        elif self.stream is not None:
            self.stream.synchronize()  # likewise: its thread waits for each prefill's first token
        host = self.inputs_host.numpy().reshape(3, n)
        host[:, t:b] = 0  # token 0 at position 0 in slot 0: the reserved block
        host[0, :t] = np.asarray(token_ids)
        host[1, :t] = np.arange(start, start + t)
        host[2, :t] = slot_ids(block_table, start, start + t, self.pool.layout.block_size).numpy()
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        prior = self.pool.slots(block_table, 0, start) if start else None
        return PrefillMeta(new_slots=self.slots[:t], prior_slots=prior)
