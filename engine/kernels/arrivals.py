"""Arrival counts for kernels whose programs split one output: each program that finishes its
share adds one to its output's count, and the one that arrives last combines the shares (in a
fixed order, so the result is deterministic) and resets the count to zero. No second kernel.

One zeroed buffer per stream: kernels on one stream never overlap (with programmatic dependent
launch a kernel still waits for the one before it to finish before touching memory), while a
partitioned prefill's kernels on another stream may run beside the decode step's.
"""

from __future__ import annotations

import torch

MAX_COUNTS = 1 << 14  # outputs a launch may count arrivals for

_counts: dict[tuple[int, int], torch.Tensor] = {}


def arrival_counts(device: torch.device) -> torch.Tensor:
    """The current stream's counts: int32 [MAX_COUNTS], zero between kernels."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        key = (stream.device_index, stream.cuda_stream)
    else:  # Triton's interpreter, which runs kernels on CPU tensors one program at a time
        key = (-1, 0)
    counts = _counts.get(key)
    if counts is None:
        counts = _counts[key] = torch.zeros(MAX_COUNTS, dtype=torch.int32, device=device)
    return counts
