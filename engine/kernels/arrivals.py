"""Arrival counts for kernels whose programs split one output: each program that finishes its
share adds one to its output's count, and the one that arrives last combines the shares (in a
fixed order, so the result is deterministic) and resets the count to zero. No second kernel.

One zeroed buffer per stream: kernels on one stream never overlap (with programmatic dependent
launch a kernel still waits for the one before it to finish before touching memory), while a
partitioned prefill's kernels on another stream may run beside the decode step's. CUDA graphs are
captured on `capture_stream`, whose buffer is made before any capture: made during one, it would
come from the graph's memory pool, where blocks other graphs' temporaries had used are handed out
again, so replaying those graphs would write over the counts (the prefill server's graphs, captured
without the decode ones, did: split kernels whose last program never came left their sums unwritten).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTS = 1 << 14  # outputs a launch may count arrivals for

# Partials of more elements than this are added in a loop, not unrolled: unrolled, a 64 x 128 tile split
# in four loads all four at once and its program spills (sm_90: 255 registers, 60 bytes spilled on four
# warps, against 128 and none; `python -m bench.micro.kernel_sass --kernel gemv --shapes down --gemv-tiles
# 128:128:4:4:4`), while the engine's tiles (up to 64 x 64) compile to the same code as before
UNROLLED_ELEMENTS = tl.constexpr(64 * 64)

_counts: dict[tuple[int, int], torch.Tensor] = {}
_capture_streams: dict[int, torch.cuda.Stream] = {}


def arrival_counts(device: torch.device) -> torch.Tensor:
    """The current stream's counts: int32 [MAX_COUNTS], zero between kernels."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        key = (stream.device_index, stream.cuda_stream)
    else:  # Triton's interpreter, which runs kernels on CPU tensors one program at a time
        key = (-1, 0)
    counts = _counts.get(key)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a split kernel captured on a stream without its arrival counts: capture on "
                               "arrivals.capture_stream(device), whose counts live outside every graph's pool")
        counts = _counts[key] = torch.zeros(MAX_COUNTS, dtype=torch.int32, device=device)
    return counts


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every CUDA graph of ours is captured on (one a device), its counts made already."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(index)
        with torch.cuda.stream(stream):
            arrival_counts(torch.device("cuda", index))
        torch.cuda.current_stream(index).wait_stream(stream)  # zeroed before any capture's kernel runs
    return stream


@triton.jit
def last_split_sums(partial, part, split_stride, mask, count, split, SPLIT_K: tl.constexpr):
    """Store this split's float32 `partial` at `part` + `split` * `split_stride` and count its arrival
    at `count`. Returns (the partials of every split added in split order, True) to the split that
    arrives last, which resets the count; (`partial`, False) to the others."""
    tl.store(part + split * split_stride, partial, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the count says so
    arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    sums = partial
    if last:  # the other splits are in: sum all in split order, whoever came last
        sums = tl.zeros_like(partial)
        if partial.numel > UNROLLED_ELEMENTS:  # the same adds in the same order, one split's loads at a time
            for i in range(SPLIT_K):
                sums += tl.load(part + i * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            for i in tl.static_range(SPLIT_K):
                sums += tl.load(part + i * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count, 0)  # ready for the next call on this stream
    return sums, last
