"""Decode attention straight from the paged KV pool (no gather copy), split over the context
("flash-decoding"): each program takes one sequence, one KV head (with its group of query heads)
and one slice of the context, and the last of a head's programs to finish merges the slices with
their softmax statistics in slice order (`engine.kernels.arrivals`): one kernel, deterministic.

Pool layer layout: [2 (K, V), num_slots, num_kv_heads, head_dim]; slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import launch
from engine.kernels.arrivals import MAX_COUNTS, arrival_counts

BLOCK_N = 64      # context tokens per inner step
# About four programs an SM on a 132-SM H200: at batch 64 two splits of the context beat one by 14%
# (1k tokens) and 18% (4k), at batch 32 four beat two by 4% and 15% (`python -m bench.decode_attention`)
TARGET_PROGRAMS = 528


@triton.jit
def _split_kernel(Q, KV, BT, BT_STRIDE, CTX, PARTIAL, ML, COUNTS, RESULT,
                  s_qb, s_qh, s_kv_kind, s_kv_slot, s_kv_head, s_bt, s_pb, s_ph, s_ps, s_mb, s_mh, s_ms,
                  s_rb, s_rh, scale_log2,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  STRIDE_ON_DEVICE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the kernel before has finished (engine.kernels.launch)
        gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    if STRIDE_ON_DEVICE:  # packed tables whose row length changes step to step (CUDA graphs)
        s_bt = tl.load(BT_STRIDE)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b)
    split_len = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for t0 in tl.range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        block = tl.load(BT + b * s_bt + offs_n // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        base = KV + slot[:, None] * s_kv_slot + kvh * s_kv_head + offs_d[None, :]
        k = tl.load(base, mask=valid[:, None], other=0.0)
        v = tl.load(base + s_kv_kind, mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if PDL:
        gdc_launch_dependents()
    result = RESULT + b * s_rb + heads[:, None] * s_rh + offs_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(result, (acc / l_i[:, None]).to(RESULT.dtype.element_ty), mask=gmask[:, None])
    else:
        part = PARTIAL + b * s_pb + heads[:, None] * s_ph + offs_d[None, :]
        ml = ML + b * s_mb + heads * s_mh
        tl.store(part + split * s_ps, acc, mask=gmask[:, None])
        tl.store(ml + split * s_ms, m_i, mask=gmask)
        tl.store(ml + split * s_ms + 1, l_i, mask=gmask)
        tl.debug_barrier()  # every thread's share is written before the count says so
        count = COUNTS + b * tl.num_programs(1) + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            # The head's last program: merge the slices that hold tokens, in slice order.
            used = tl.cdiv(ctx, split_len)
            m_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
            for i in range(0, used):
                m_max = tl.maximum(m_max, tl.load(ml + i * s_ms, mask=gmask, other=0.0, cache_modifier=".cg"))
            out = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
            total = tl.zeros([GROUP_PAD], dtype=tl.float32)
            for i in range(0, used):
                w = tl.exp2(tl.load(ml + i * s_ms, mask=gmask, other=0.0, cache_modifier=".cg") - m_max)
                total += w * tl.load(ml + i * s_ms + 1, mask=gmask, other=0.0, cache_modifier=".cg")
                out += w[:, None] * tl.load(part + i * s_ps, mask=gmask[:, None], other=0.0, cache_modifier=".cg")
            tl.store(result, (out / total[:, None]).to(RESULT.dtype.element_ty), mask=gmask[:, None])
            tl.atomic_xchg(count, 0)  # ready for the next launch on this stream


def num_splits_for(batch: int, num_kv_heads: int) -> int:
    splits = max(1, TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    return min(64, triton.next_power_of_2(splits))


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int,
                           table_stride: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """q [B, H, D]; kv_layer [2, slots, Hkv, D]; block_tables [B, max_blocks] int32 with unit column
    stride; context_lens [B] int32 (each at least 1) -> [B, H, D]. `table_stride` (a device int32
    scalar), when given, overrides the tables' row stride; `splits` the context splits
    `num_splits_for` picks. Shapes only, no host sync: safe inside a CUDA graph."""
    batch, heads, dim = q.shape
    kv_heads = kv_layer.shape[2]
    group = heads // kv_heads
    splits = splits or num_splits_for(batch, kv_heads)
    assert splits == 1 or batch * kv_heads <= MAX_COUNTS, f"{batch} x {kv_heads} heads: split them over launches"
    out = torch.empty_like(q)
    partial = ml = counts = out
    if splits > 1:
        partial = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
        counts = arrival_counts(q.device)
    scale_log2 = (dim ** -0.5) * 1.4426950408889634
    _split_kernel[(batch, kv_heads, splits)](
        q, kv_layer, block_tables, table_stride if table_stride is not None else context_lens, context_lens,
        partial, ml, counts, out,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2) if splits > 1 else 0,
        ml.stride(0), ml.stride(1), ml.stride(2) if splits > 1 else 0, out.stride(0), out.stride(1),
        scale_log2, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim,
        BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, NUM_SPLITS=splits, STRIDE_ON_DEVICE=table_stride is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 models: no TF32 rounding
        num_warps=4, num_stages=2, **launch.options())
    return out
