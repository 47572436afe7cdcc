"""Decode steps replayed as CUDA graphs, one per batch-size bucket and side.

A step's inputs live in static device buffers; a replay costs one graph launch. Rows past the real
batch are padding: they write their KV into the pool's reserved block 0 and attend over one token,
and nobody reads their logits. Buckets start at `min_bucket`: with 8, a sequence's step runs the
same kernels whether it decodes alone or beside up to 7 others, so its tokens do not depend on who
else is in the batch.

Steps alternate between two sides, each with its own metadata buffers and greedy-token buffer, and
graphs captured for each. The next step's metadata is uploaded on a copy stream into the side the
running step does not read, and its rows take the last step's tokens from the other side's buffer
inside the graph: between two graphs the compute stream runs nothing but the tokens' read-back
(what that saves a step: bench/NOTES.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import DecodeMeta
from engine.decode_batch import DecodeSeq, TableRows, sources, table_width, write_meta
from engine.kernels.arrivals import arrival_counts, capture_stream
from engine.kv_cache import KVPool
from engine.logprobs import device_tensor
from engine.model import DecoderModel

log = logging.getLogger(__name__)


def capture(work: Callable[[], object], device: torch.device, graph_pool: tuple[int, int] | None = None,
            settle: Callable[[], None] | None = None, stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
    """`work` as a CUDA graph (in `graph_pool`), after two eager runs that compile its Triton kernels, build
    its cuDNN plans and settle cuBLAS; `settle` runs after each of them, to put back what a run changed
    that the graph must find as it was. Captured on `arrivals.capture_stream`, where split kernels find
    their arrival counts; or on `stream` (a green context's, whose kernels keep to its SMs, then replayed
    there), its counts made first and the eager runs on it too: no event crosses from it to another
    stream."""
    if stream is None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
    else:
        side = stream
        with torch.cuda.stream(stream):
            arrival_counts(device)  # made outside the graph's pool
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
            if settle is not None:
                settle()
    if stream is None:
        torch.cuda.current_stream().wait_stream(side)
    else:
        stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    on = capture_stream(device) if stream is None else stream
    with torch.cuda.graph(graph, pool=graph_pool, stream=on):  # type: ignore[arg-type]
        work()
    return graph


def bucket_sizes(max_batch: int, min_bucket: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if min_bucket <= b < max_batch]
    return [*sizes, max_batch]


class _Side:
    """One of the two alternating sets of a step's buffers. One int32 buffer holds ids, positions,
    new slots, context lengths, source rows [5, n], the tables' row length `width`, then the block
    tables packed row-major [b, width], width being the longest table of the step. A step uploads one
    contiguous prefix of its pinned twin (a strided or pageable copy would stage through the driver
    and cost tens of microseconds of host time); the attention kernel reads the row stride from the
    device. `tokens` holds the greedy tokens of this side's last step."""

    def __init__(self, n: int, blocks: int, device: torch.device) -> None:
        self.staging = torch.zeros(5 * n + 1 + n * blocks, dtype=torch.int32, device=device)
        self.staging_host = torch.zeros(5 * n + 1 + n * blocks, dtype=torch.int32, pin_memory=True)
        self.ids, self.positions, self.slots, self.lens, self.sources = self.staging[:5 * n].view(5, n).unbind(0)
        self.width = self.staging[5 * n:5 * n + 1]
        self.tables = self.staging[5 * n + 1:].view(n, blocks)  # nominal shape; rows are `width` apart
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.host = self.staging_host.numpy()
        self.meta_np = self.host[:4 * n].reshape(4, n)
        self.sources_np = self.host[4 * n:5 * n]
        self.table_rows = TableRows()
        self.uploaded = torch.cuda.Event()  # its last upload is done: the pinned buffer is free
        self.graph_done = torch.cuda.Event()  # its last graph has run: the device buffers are free
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}


class DecodeGraphs:
    """Decode steps of `model` over `pool` for up to `max_batch` sequences of up to `max_model_len` tokens."""

    def __init__(self, model: DecoderModel, pool: KVPool, max_batch: int, max_model_len: int,
                 min_bucket: int = 1) -> None:
        self.model, self.pool, self.max_batch, self.max_model_len = model, pool, max_batch, max_model_len
        self.block_size = pool.layout.block_size
        self.buckets = bucket_sizes(max_batch, min(min_bucket, max_batch))
        blocks = -(-max_model_len // self.block_size)
        self.sides = (_Side(max_batch, blocks, pool.device), _Side(max_batch, blocks, pool.device))
        self._next = 0  # the side of the next step
        self._uploads = torch.cuda.Stream(pool.device)
        started = time.perf_counter()
        graph_pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            for side in (0, 1):
                self._capture(b, side, graph_pool)
        log.info("captured %d decode CUDA graphs (buckets %s, two sides) in %.1fs", 2 * len(self.buckets),
                 self.buckets, time.perf_counter() - started)

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        """One side's graph per bucket (what a benchmark replays to time a step alone)."""
        return self.sides[0].graphs

    def _forward(self, b: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, last = self.sides[side], self.sides[1 - side]
        meta = DecodeMeta(s.slots[:b], s.tables[:b], s.lens[:b], self.max_model_len, use_kernel=True,
                          table_stride=s.width)
        return self.model.decode_forward(s.ids[:b], s.positions[:b], self.pool, meta,
                                         feed=(s.sources[:b], last.tokens), tokens=s.tokens[:b])

    def _capture(self, b: int, side: int, graph_pool: tuple[int, int]) -> None:
        s = self.sides[side]
        s.sources.fill_(-1)  # the warm-up runs take every token from the host

        def step() -> None:  # the captured run's logits are the ones each replay writes
            s.logits[b], _ = self._forward(b, side)

        s.graphs[b] = capture(step, self.pool.device, graph_pool)

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, seqs: list[DecodeSeq], previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and greedy tokens [n] of one decode step (device tensors); rows with a
        `source_row` take their token from `previous`, the last step's tokens on the device."""
        n = len(seqs)
        b = self.bucket_for(n)
        side = self._next
        s, last = self.sides[side], self.sides[1 - side]
        rows = sources(seqs)
        s.uploaded.synchronize()  # at once in practice: that copy ran before the step before last
        width = table_width(seqs, self.block_size)
        off = 5 * self.max_batch
        s.sources_np[:n] = -1 if rows is None else self._feedable(rows, previous, last.tokens)
        s.sources_np[n:b] = -1
        s.host[off] = width
        tables = s.host[off + 1:off + 1 + b * width].reshape(b, width)
        meta = s.meta_np
        write_meta(seqs, self.block_size, meta)
        s.table_rows.write(seqs, self.block_size, tables)
        meta[:, n:b] = 0  # padding rows: reserved block 0, one token
        meta[3, n:b] = 1
        tables[n:b, 0] = 0
        upload = off + 1 + b * width
        compute = torch.cuda.current_stream(self.pool.device)
        self._uploads.wait_event(s.graph_done)  # the graph that last read this side has run
        with torch.cuda.stream(self._uploads):
            s.staging[:upload].copy_(s.staging_host[:upload], non_blocking=True)
            s.uploaded.record()
        compute.wait_event(s.uploaded)
        s.graphs[b].replay()
        s.graph_done.record(compute)
        self._next = 1 - side
        return s.logits[b][:n], s.tokens[:n]

    def _feedable(self, rows: np.ndarray, previous: torch.Tensor | None, tokens: torch.Tensor) -> np.ndarray:
        """The rows of `tokens` (the other side's buffer, which the graph feeds from) holding each
        row's source token. `previous` is usually that buffer already (the last step's greedy
        tokens); sampled tokens (a grammar's or a penalty's rows, or sampled ones), or an eager step's,
        are first gathered into it on the compute stream, their index uploaded from pinned memory: from
        pageable memory the copy may wait for the stream, the step before still on it."""
        assert previous is not None, "a row takes its token from the previous step: pass that step's tokens"
        if previous.data_ptr() == tokens.data_ptr():
            return rows
        fed = rows >= 0
        index = device_tensor(rows[fed], torch.long, tokens.device)
        tokens[:len(index)] = previous[index]
        compact = np.full_like(rows, -1)
        compact[fed] = np.arange(len(index))
        return compact
