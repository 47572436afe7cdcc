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
        # One int32 buffer: ids, positions, new slots, context lengths [4, n], then the block tables
        # stored block-major [nb, n]. A step uploads one contiguous prefix of its pinned twin, as
        # far as the longest table reaches (a strided or pageable copy would stage through the
        # driver and cost tens of microseconds of host time).
        self.staging = torch.zeros(4 * n + nb * n, dtype=torch.int32, device=dev)
        self.staging_host = torch.zeros(4 * n + nb * n, dtype=torch.int32, pin_memory=True)
        self.ids, self.positions, self.slots, self.lens = self.staging[:4 * n].view(4, n).unbind(0)
        self.tables = self.staging[4 * n:].view(nb, n).t()  # [n, nb], strides (1, n)
        self._meta_np = self.staging_host[:4 * n].view(4, n).numpy()
        self._tables_np = self.staging_host[4 * n:].view(nb, n).numpy()  # block-major
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
        bs = self.runner.layout.block_size
        meta, tables = self._meta_np, self._tables_np
        width = 1
        for row, s in enumerate(seqs):
            used = s.position // bs + 1
            meta[0, row], meta[1, row] = s.token, s.position
            meta[2, row], meta[3, row] = s.block_table[used - 1] * bs + s.position % bs, s.position + 1
            tables[:used, row] = s.block_table[:used]  # entries past `used` are never read
            width = max(width, used)
        meta[:, n:b] = 0  # padding rows: reserved block 0, one token
        meta[3, n:b] = 1
        tables[0, n:b] = 0
        # the previous step's copy finished: its tokens were read back before this step began
        upload = self.max_batch * (4 + width)
        self.staging[:upload].copy_(self.staging_host[:upload], non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n], self.greedy[b][:n]
