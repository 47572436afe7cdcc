"""Warm-up at start-up: every kernel a request can need is compiled, planned and allocated before
the server says SERVING, so no request pays a first use (a first chunked request paid 60-235 ms
on one H200; bench/NOTES.md).

What a first use costs on CUDA: Triton compiles a kernel for each specialization of its integer
arguments (a length of 1, a multiple of 16, any other) and of its constants (the rope kernel's
token block: one token a program up to 64 tokens, 16 beyond); cuDNN builds a plan for each
attention shape (built per thread, `prepare_prefill_plans`); the caching allocator reserves its
largest blocks at the first prompt that needs them. So each path runs once at the lengths that
reach every one of those: whole prompts (colocated, and the prefill server's), chunks of every
allowed size with and without a cached prefix, layer slices, and sampling; those of up to 512 tokens
both as prefill graphs replay them and eagerly (the partitioned thread's prefills, and a prompt's own
log probabilities, run eagerly). Each stage is timed and logged. Runs on the engine thread, into
blocks it takes from the empty pool and gives back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np
import torch

from engine.host_read import TokenReader
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample

log = logging.getLogger(__name__)

# A length of 1, multiples of 16 and others, each side of the rope kernel's 64-token switch and of
# the fused gate/up MLP's 4096 rows.
WHOLE_PROMPT_LENGTHS = (1, 15, 16, 64, 65, 100, 4095, 4096, 4100)
SLICED_PROMPT_TOKENS = 4100


class WarmUp:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.longest = runner.max_model_len - 1  # a prompt leaves room for one token
        self.stages: dict[str, float] = {}  # seconds each stage took

    def run(self, stage: str, work: Callable[[], object]) -> None:
        started = time.perf_counter()
        work()
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self.stages[stage] = time.perf_counter() - started
        log.info("warm-up: %s in %.2fs", stage, self.stages[stage])

    def _prompt(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64) % self.runner.config.vocab_size

    def _with_blocks(self, tokens: int, work: Callable[[list[int]], object]) -> None:
        allocator = self.runner.pool.allocator
        table = allocator.allocate(self.runner.pool.blocks_needed(tokens))
        try:
            work(table)
        finally:
            allocator.free(table)

    def whole_prompts(self) -> None:
        """Colocated prefill (and the prefill server's): every specialization, then the longest prompt."""
        for n in sorted({*(n for n in WHOLE_PROMPT_LENGTHS if n <= self.longest), self.longest}):
            self._with_blocks(n, partial(self._chunked, self._prompt(n), size=n))

    def chunks(self, sizes: Iterable[int]) -> None:
        """Chunked prefill at each size: a first chunk, one after a cached prefix, and a short last
        one; then the longest prompt at the largest size (the longest cached prefix)."""
        fitting = [size for size in sizes if size < self.longest]
        runs = [(size, min(2 * size + 5, self.longest)) for size in fitting]
        if fitting:
            runs.append((max(fitting), self.longest))
        for size, n in runs:
            self._with_blocks(n, partial(self._chunked, self._prompt(n), size=size))

    def _chunked(self, prompt: np.ndarray, table: list[int], *, size: int) -> None:
        graphs = self.runner.prefill_graphs
        for start in range(0, len(prompt), size):
            piece = prompt[start:start + size]
            self.runner.prefill(piece, table, start)
            if graphs is not None and graphs.fits(len(piece)):  # and eagerly, over the same slots
                self.runner.prefill(piece, table, start, graphed=False)

    def layer_slices(self, slice_tokens: int) -> None:
        n = min(SLICED_PROMPT_TOKENS, self.longest)
        self._with_blocks(n, lambda table: list(self.runner.prefill_slices(self._prompt(n), table, slice_tokens)))

    def sampling(self, reader: TokenReader) -> None:
        """Greedy and seeded top-k/top-p sampling, read back as a step reads its tokens."""
        logits = torch.zeros(2, self.runner.config.vocab_size, device=self.runner.device)
        params = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1)]
        reader.read(sample(logits, params, [0, 0]))
