"""Weights asked of L2 before a decode kernel waits on the one before it.

With programmatic dependent launch (`engine.kernels.launch`) a kernel's programs are scheduled
while the kernel before it drains, then wait for it before reading activations. A matmul's
weights depend on no kernel, so each program first asks L2 for the start of its weight rows
(Hopper's bulk prefetch, one instruction a row, nothing held in registers or shared memory):
HBM streams during the previous kernel's tail, when only its last programs are reading, instead
of after it. The loads that follow read the same bytes, so results do not change.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_to_l2(first, row_bytes, nbytes, nrows):
    """Prefetch `nbytes` (a multiple of 16) from each of `nrows` rows `row_bytes` apart, the first at
    `first` (16-byte aligned), into L2: one request a row, from the program's thread of that index."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        .reg .u64 a;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, $4;
        mad.wide.u32 a, t, $3, $1;
        @p cp.async.bulk.prefetch.L2.global [a], $2;
        mov.u32 $0, 0;
        }""", "=r,l,r,r,r", [first, nbytes, row_bytes, nrows], dtype=tl.int32, is_pure=False, pack=1)
