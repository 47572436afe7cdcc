"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A step's inputs live in static device buffers; a replay costs one host-to-device copy of the
step's metadata and one graph launch. Rows past the real batch are padding: they write their KV
into the pool's reserved block 0 and attend over one token, and nobody reads their logits.
Buckets start at `min_bucket`: with 8, a sequence's step runs the same kernels whether it decodes
alone or beside up to 7 others, so its tokens do not depend on who else is in the batch.
"""

from __future__ import annotations

import logging
import time

import torch

from engine import ops
from engine.attention import DecodeMeta
from engine.decode_batch import DecodeSeq, TableRows, sources, table_width, write_meta
from engine.kv_cache import KVPool
from engine.model import DecoderModel

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int, min_bucket: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if min_bucket <= b < max_batch]
    return [*sizes, max_batch]


class DecodeGraphs:
    """Decode steps of `model` over `pool` for up to `max_batch` sequences of up to `max_model_len` tokens."""

    def __init__(self, model: DecoderModel, pool: KVPool, max_batch: int, max_model_len: int,
                 min_bucket: int = 1) -> None:
        self.model, self.pool, self.max_batch, self.max_model_len = model, pool, max_batch, max_model_len
        self.block_size = pool.layout.block_size
        self.buckets = bucket_sizes(max_batch, min(min_bucket, max_batch))
        dev, n, nb = pool.device, max_batch, -(-max_model_len // self.block_size)
        # One int32 buffer: ids, positions, new slots, context lengths, source rows [5, n], the tables' row
        # length `width`, then the block tables packed row-major [b, width], width being the longest
        # table of the step. A step uploads one contiguous prefix of its pinned twin (a strided or
        # pageable copy would stage through the driver and cost tens of microseconds of host time);
        # the attention kernel reads the row stride from the device.
        self.staging = torch.zeros(5 * n + 1 + n * nb, dtype=torch.int32, device=dev)
        self.staging_host = torch.zeros(5 * n + 1 + n * nb, dtype=torch.int32, pin_memory=True)
        self.ids, self.positions, self.slots, self.lens, self.sources = self.staging[:5 * n].view(5, n).unbind(0)
        self.width = self.staging[5 * n:5 * n + 1]
        self.tables = self.staging[5 * n + 1:].view(n, nb)  # nominal shape; rows are `width` apart
        self._host = self.staging_host.numpy()
        self._meta_np = self._host[:4 * n].reshape(4, n)
        self._sources_np = self._host[4 * n:5 * n]
        self._table_rows = TableRows()
        self._uploaded = torch.cuda.Event()  # the last step's staging copy is done: the pinned buffer is free
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        graph_pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._capture(b, graph_pool)
        log.info("captured %d decode CUDA graphs (buckets %s) in %.1fs", len(self.buckets), self.buckets,
                 time.perf_counter() - started)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = DecodeMeta(self.slots[:b], self.tables[:b], self.lens[:b], self.max_model_len, use_kernel=True,
                          table_stride=self.width)
        return self.model.decode_forward(self.ids[:b], self.positions[:b], self.pool, meta)

    def _capture(self, b: int, graph_pool: tuple[int, int]) -> None:
        stream = torch.cuda.Stream(self.pool.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the Triton kernels and settle cuBLAS before capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_pool):  # type: ignore[arg-type]
            self.logits[b], self.greedy[b] = self._forward(b)
        self.graphs[b] = graph

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, seqs: list[DecodeSeq], previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and greedy tokens [n] of one decode step (device tensors); rows with a
        `source_row` take their token from `previous`, the last step's tokens on the device."""
        n = len(seqs)
        b = self.bucket_for(n)
        self._uploaded.synchronize()  # at once in practice: that copy ran before the step whose tokens were read
        meta = self._meta_np
        width = table_width(seqs, self.block_size)
        off = 5 * self.max_batch
        rows = sources(seqs)
        if rows is not None:
            self._sources_np[:n] = rows
        self._host[off] = width
        tables = self._host[off + 1:off + 1 + b * width].reshape(b, width)
        write_meta(seqs, self.block_size, meta)
        self._table_rows.write(seqs, self.block_size, tables)
        meta[:, n:b] = 0  # padding rows: reserved block 0, one token
        meta[3, n:b] = 1
        tables[n:b, 0] = 0
        upload = off + 1 + b * width
        self.staging[:upload].copy_(self.staging_host[:upload], non_blocking=True)
        self._uploaded.record()
        if rows is not None:
            assert previous is not None, "a row takes its token from the previous step: pass that step's tokens"
            ops.feed_tokens(self.ids[:n], self.sources[:n], previous)
        self.graphs[b].replay()
        return self.logits[b][:n], self.greedy[b][:n]
