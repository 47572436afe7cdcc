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
from typing import TYPE_CHECKING

import torch

from engine.attention import DecodeMeta

if TYPE_CHECKING:
    from engine.runner import DecodeSeq, ModelRunner

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int, min_bucket: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if min_bucket <= b < max_batch]
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, min_bucket: int = 1) -> None:
        self.runner = runner
        self.max_batch = runner.max_batch_size
        self.buckets = bucket_sizes(self.max_batch, min(min_bucket, self.max_batch))
        dev, n, nb = runner.device, self.max_batch, runner.max_blocks_per_seq
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, nb, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._capture(b, pool)
        log.info("captured %d decode CUDA graphs (buckets %s) in %.1fs", len(self.buckets), self.buckets,
                 time.perf_counter() - started)

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = DecodeMeta(self.slots[:b], self.tables[:b], self.lens[:b], self.runner.max_model_len, use_kernel=True)
        logits = self.runner.model(self.ids[:b], self.positions[:b], self.runner.pool, meta)
        return logits, logits.argmax(dim=-1)

    def _capture(self, b: int, pool: tuple[int, int]) -> None:
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the Triton kernels and settle cuBLAS before capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]
            self.logits[b], self.greedy[b] = self._forward(b)
        self.graphs[b] = graph

    def bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, seqs: list[DecodeSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, V] and greedy tokens [n] of one decode step (device tensors)."""
        n = len(seqs)
        b = self.bucket_for(n)
        ids, positions, slots, tables, lens = self.runner.decode_meta_tensors(seqs)
        used = tables.shape[1]
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.lens[:n].copy_(lens, non_blocking=True)
        self.tables[:n, :used].copy_(tables, non_blocking=True)
        if b > n:  # padding rows: reserved block 0, one token
            self.slots[n:b].zero_()
            self.lens[n:b].fill_(1)
            self.tables[n:b, :1].zero_()
        self.graphs[b].replay()
        return self.logits[b][:n], self.greedy[b][:n]
