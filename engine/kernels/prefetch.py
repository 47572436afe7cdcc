"""Weights into L2 while HBM would otherwise idle.

At small batches a decode step is the projections' weight streaming with latency-bound kernels
between them: the norms, and the attention over short contexts, each a few µs in which HBM reads
next to nothing, after which the next projection ramps up from cold. Those kernels ask L2 for the
next projection's first bytes (Hopper's bulk prefetch: no registers, nothing to wait for) before
their own wait on the kernel before them, so the projection starts on L2 hits. A hint only: it
moves no data the kernels see, so results keep their bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Bytes asked for ahead of the MLP's gate/up projection and the lm_head: what HBM reads in the few
# µs of the norm before them. The attention projections are asked for whole (25-35 MB at the 7B shape).
HEAD_BYTES = 16 << 20


@triton.jit
def prefetch_l2(BASE, num_bytes, part, parts, LANES: tl.constexpr):
    """Program `part` of `parts` asks L2 for its share of the `num_bytes` from BASE: LANES pieces,
    one a thread, each a whole number of 16-byte units (the instruction's granule)."""
    piece = tl.cdiv(tl.cdiv(num_bytes, parts * LANES), 16) * 16
    start = (part * LANES + tl.arange(0, LANES)).to(tl.int64) * piece
    size = (tl.maximum(tl.minimum(num_bytes - start, piece), 0) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [BASE.to(tl.pointer_type(tl.int8)) + start, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(t: torch.Tensor) -> bool:
    """A tensor on a Hopper or later GPU (the bulk prefetch is sm_90's)."""
    return t.is_cuda and _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def head_bytes(weight: torch.Tensor, limit: int | None = None) -> int:
    """The bytes of `weight` to ask for: all of it, or its first `limit`."""
    total = weight.numel() * weight.element_size()
    return total if limit is None else min(total, limit)

