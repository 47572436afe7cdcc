"""The decode step's attention as the engine's split kernel runs it (engine/kernels/paged_decode.py).

The kernel's grid is fixed per CUDA-graph bucket: `num_splits_for` gives every (sequence, KV head) the
same number of context splits, chosen from the bucket's size alone, and each program reads one split
from start to end. One program's loop (a block-table load, then its K and V tiles) is bound by memory
latency, not by the HBM's bandwidth, so a layer takes as long as its longest program: a long history
in a large batch is read by one or two programs a KV head, long after the rest of the batch is done.
The cost is therefore priced from the longest context and the bucket, not only from the total tokens.

The grid holds 192-256 programs on the H200's 132 SMs, about two an SM, and a program's loop runs
slower beside another on its SM (12.4 GB/s at batch 64 of equal 1,024-token contexts) than alone
(18.2 GB/s in `bench.micro.decode_attention`'s rows with at most one program an SM). The longest program
shares its SM while the batch's other programs run (about the mean context, cut the same way) and
reads the rest of its history after them, at the rate measured for that case (one 16k history among
1k ones, `--long-context`: 16.5 GB/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# The model's shape and the kernel's constants (checked against the engine's in tests/test_planner.py)
LAYERS = 28
KV_HEADS = 4
HEAD_BYTES_PER_TOKEN = 512       # K and V of one KV head of one layer: 2 x 128 x 2 bytes
BLOCK_N = 64                     # context tokens per inner step: a split is a whole number of them
# paged_decode.TARGET_PROGRAMS when the recorded load runs were served; the engine took 528 from 47c7708 on
# (two splits at batch 64), with overlapped steps: the simulator prices the engine those runs measured
TARGET_PROGRAMS = 264
ENGINE_TARGET_PROGRAMS_NOW = 528
MAX_SPLITS = 64                  # the engine's cap then; it caps at 32 since (paged_decode.MAX_SPLITS)
SMS = 132                        # the H200's SMs: a grid of at most this many programs runs one an SM
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # engine.cuda_graphs.bucket_sizes
ENGINE_CONTEXT = 1024            # bench.micro.engine_steps's decode steps run at this context per sequence
# A lab figure (bench/NOTES.md, the reverted "one wave of attention splits"): at batch 32 with 1,024-token
# contexts, one split a (sequence, KV head) instead of two made the step 0.6 ms slower: the same bytes,
# read by half as many programs of twice the length.
ONE_WAVE_SPLITS = (1, 2)
ONE_WAVE_STEP_MS_SLOWER = 0.6


def bucket_for(batch: int, max_batch: int = 64) -> int:
    """The CUDA graph a decode step of `batch` sequences replays (engine.cuda_graphs.DecodeGraphs.bucket_for)."""
    return next((b for b in BUCKETS if b >= batch and b < max_batch), max_batch)


def num_splits(bucket: int) -> int:
    """paged_decode.num_splits_for: TARGET_PROGRAMS over bucket x KV heads, up to a power of two."""
    splits = max(1, TARGET_PROGRAMS // max(1, bucket * KV_HEADS))
    return min(MAX_SPLITS, 1 << (splits - 1).bit_length())


def split_tokens(context: int, splits: int) -> int:
    """Tokens the first program of a sequence reads: its context cut in `splits`, rounded up to BLOCK_N."""
    return math.ceil(math.ceil(context / splits) / BLOCK_N) * BLOCK_N


def longest_program_bytes(longest: int, total_tokens: float, batch: int, splits: int) -> tuple[int, int]:
    """The longest program's bytes, and how many of them it reads beside the batch's other programs: as many as
    the batch's mean program holds (its mean context cut the same way)."""
    program = split_tokens(max(1, longest), splits) * HEAD_BYTES_PER_TOKEN
    mean = split_tokens(max(1, math.ceil(total_tokens / batch)), splits) * HEAD_BYTES_PER_TOKEN
    return program, min(program, mean)


@dataclass(frozen=True)
class AttentionModel:
    """A layer's split kernel: `launch_us` + the longest program's time, or the layer's whole KV at the HBM rate
    when that is longer (never, with the engine's 256 programs at 12 GB/s). The longest program reads at
    `program_gbps` (beside another program on its SM) as many bytes as the batch's mean program holds, and the
    rest at `alone_gbps` (alone on its SM, the others done); without `alone_gbps`, all at `program_gbps`."""

    launch_us: float
    program_gbps: float
    hbm_gbps: float
    alone_gbps: float | None = None

    def layer_us(self, bucket: int, longest: int, total_tokens: float, batch: int = 0) -> float:
        splits = num_splits(bucket)
        program = shared = split_tokens(max(1, longest), splits) * HEAD_BYTES_PER_TOKEN
        if self.alone_gbps is not None and batch > 0:
            program, shared = longest_program_bytes(longest, total_tokens, batch, splits)
        alone = self.alone_gbps or self.program_gbps
        program_us = shared / (self.program_gbps * 1e3) + (program - shared) / (alone * 1e3)
        whole = total_tokens * HEAD_BYTES_PER_TOKEN * KV_HEADS
        return self.launch_us + max(program_us, whole / (self.hbm_gbps * 1e3))

    def step_ms(self, batch: int, longest: int, total_tokens: float, max_batch: int = 64) -> float:
        return LAYERS * self.layer_us(bucket_for(batch, max_batch), longest, total_tokens, batch) / 1e3


def attention_points(engine: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Rows [1, longest program's bytes] -> µs a layer, from bench.micro.engine_steps's profile of the split kernel at
    its batches (its `context` tokens each), and the lab's one-wave figure as a difference [0, Δbytes]."""
    xs, ys = [], []
    context = int(engine.get("context", ENGINE_CONTEXT))
    for batch, kernels in engine.get("decode_profile", {}).items():
        split = [k for k in kernels if k["kernel"] == "_split_kernel"]
        if split:
            tokens = split_tokens(context, num_splits(bucket_for(int(batch))))
            xs.append([1.0, tokens * HEAD_BYTES_PER_TOKEN])
            ys.append(split[0]["us_per_step"] / LAYERS)
    one, two = (split_tokens(ENGINE_CONTEXT, s) for s in ONE_WAVE_SPLITS)
    xs.append([0.0, (one - two) * HEAD_BYTES_PER_TOKEN])
    ys.append(ONE_WAVE_STEP_MS_SLOWER * 1e3 / LAYERS)
    return np.array(xs), np.array(ys)


def alone_points(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows [1, a program's bytes] -> µs a layer, from `bench.micro.decode_attention`'s rows (equal contexts, a given
    split count) whose grid has at most one program an SM: each program runs alone on its SM."""
    alone = [r for r in rows if int(r["batch"]) * KV_HEADS * int(r["splits"]) <= SMS]
    xs = [[1.0, split_tokens(int(r["context"]), int(r["splits"])) * HEAD_BYTES_PER_TOKEN] for r in alone]
    return np.array(xs).reshape(-1, 2), np.array([float(r["us"]) for r in alone])
