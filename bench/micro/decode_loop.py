"""Decode steps as the decode server runs them, for the benchmarks that time them (`bench.micro.engine_steps`'s
step, the later turns' running batch): each step queued before the last one's tokens are read back,
its rows taking those tokens on the device (overlapped), or queued and read back before the next."""

from __future__ import annotations

import torch

from engine.decode_batch import DecodeSeq
from engine.host_read import TokenReader
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample


def sync(runner: ModelRunner) -> None:
    """Wait for the runner's device (nothing to wait for on the CPU)."""
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


class DecodeLoop:
    """Greedy decode steps of the sequences in `tables`, each `position` tokens long at the start."""

    def __init__(self, runner: ModelRunner, tables: list[list[int]], position: int, overlap: bool) -> None:
        self.runner, self.tables, self.position, self.overlap = runner, tables, position, overlap
        self.params = [SamplingParams()] * len(tables)
        self.last = [1] * len(tables)  # the tokens each row takes from the host
        self.readers = [TokenReader(runner.device, len(tables)) for _ in range(2)]
        self.in_flight: tuple[torch.Tensor, TokenReader] | None = None  # the step queued, not yet read back
        self.launched = 0

    def step(self) -> bool:
        """One step queued; returns whether a step's tokens were read back in it (not at the first
        overlapped step, which only queues)."""
        previous, self.in_flight = self.in_flight, None
        n = len(self.tables)
        if previous is None:
            seqs = [DecodeSeq(self.last[i], self.position, t) for i, t in enumerate(self.tables)]
        else:
            seqs = [DecodeSeq(0, self.position, t, i) for i, t in enumerate(self.tables)]
        logits, greedy = self.runner.decode(seqs, previous[0] if previous is not None else None)
        tokens = sample(logits, self.params, [self.position] * n, greedy)
        reader = self.readers[self.launched % 2]  # the other may hold the step in flight
        self.launched += 1
        reader.start(tokens)
        self.position += 1
        if not self.overlap:
            self.last = reader.take()
            return True
        self.in_flight = (tokens, reader)
        if previous is None:
            return False
        self.last = previous[1].take()
        return True
