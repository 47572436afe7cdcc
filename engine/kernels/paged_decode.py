"""Decode attention straight from the paged KV pool (no gather copy), split over the context
("flash-decoding"): each program takes one sequence, one KV head (with its group of query heads)
and one slice of the context; a second kernel merges the slices that hold tokens with their
softmax statistics (one slice: no merge, the program writes the result).

With `paged_decode_attention_rope` the kernel also does what `ops.rope_and_store` does for a decode
step: it rotates each query from the qkv projection's output as it loads it, and the program whose
slice ends at the new token rotates that token's key and writes it and its value into the pool
before reading its slice. A step saves a launch a layer that way (the rope kernel's, 2-4 µs each
at small batches), with the same rounding, so the pool and the result keep their bits.

Pool layer layout: [2 (K, V), num_slots, num_kv_heads, head_dim]; slot = block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels import launch
from engine.kernels.fused import store_e4m3_row
from engine.kernels.gemv import E4m3Rows


@dataclass(frozen=True)
class DecodeTile:
    """Context tokens per inner step, the loads a program keeps in flight (`num_stages` - 1), its
    warps, and a cap on its registers a thread (None: the compiler's choice), which sets how many
    programs an SM holds."""

    block_n: int = 64
    num_stages: int = 2
    num_warps: int = 4
    max_registers: int | None = None
    word_loads: bool = False  # an e4m3 pool's K and V read as 32-bit words (`_e4m3_words_to_f16`)


# per pool dtype: an e4m3 tile of 64 tokens holds half the bytes of a 16-bit one, so half as many are
# in flight; 128 tokens a step take one layer of batch 64 at a 1k context from 47.8 to 37.2 us on an
# H200 (bench/results/decode-attention-fp8-tiles-h200.json; bf16's 64-token tile: 43.8 us)
DECODE_TILES: dict[torch.dtype, DecodeTile] = {torch.float8_e4m3fn: DecodeTile(128, 3)}

# From batch 32 on, other tiles. bf16's is capped at 128 registers a thread: a layer at batch 64 and a 1k
# context 40.8 -> 39.3 us, batch 32 25.2 -> 24.9 (bench/results/paged-attention-registers-h200.json); the
# byte-loading e4m3 tile capped so took 33.7 us where it took 36.8 uncapped (207 registers, two programs an SM).
# At batches 1-8 the cap was slower (e4m3: 5.8-8.8 -> 6.8-11.7 us), its programs being few anyway.
# The e4m3 tile pipelines five stages: the block table's load, a stage ahead of the KV loads it addresses,
# takes a buffer of its own, so three or four stages keep one KV tile in flight and five keep two. At batch
# 64 and a 4k context 112.7 -> 105.7 us, at 1k 33.3 -> 32.6, batch 32 at 1k 20.7 -> 20.9; the bf16 tile at
# five stages holds two 32 KB tiles and lost, 39.3 -> 49.1 us (bench/results/paged-attention-depth-h200.json)
# The e4m3 tile from batch 32 reads K and V as words on two warps, uncapped: a layer at batch 64 and a 1k
# context 32.9 -> 29.5 us, 4k 105.0 -> 91.4; batch 32 21.0 -> 19.3 and 57.6 -> 51.4 (four splits)
# (bench/results/paged-attention-e4m3-words-h200.json). Below 32 the byte loads stay: words measured
# 8.7 -> 9.9 us at batch 8 and a 1k context on the 128-token tile.
CAPPED_FROM_BATCH = 32
CAPPED_TILES: dict[torch.dtype, DecodeTile] = {torch.float8_e4m3fn: DecodeTile(64, 5, 2, word_loads=True),
                                               torch.bfloat16: DecodeTile(64, 2, 4, max_registers=128)}


# An e4m3 pool's batches of 8-31 step 64 tokens on two warps. A step of the FP8 preset on an H200, 4k context:
# batch 8 3.43 -> 3.29 ms, batch 16 3.71 -> 3.56; 1k context, batch 8 2.98 -> 2.92. Batch 4 lost (1k 2.88 -> 2.97,
# 4k 3.19 -> 3.23), where an H100's kernel sweep had it win (bench/results/engine-fp8-kv-fp8-middle-tile-*-ab-h200.json,
# decode-attention-fp8-small-batches-h100.json). Below 8 the 128-token tile stays.
MIDDLE_FROM_BATCH = 8
MIDDLE_TILES: dict[torch.dtype, DecodeTile] = {torch.float8_e4m3fn: DecodeTile(64, 3, 2)}


def decode_tile(kv_dtype: torch.dtype, batch: int = 1) -> DecodeTile:
    """The tile of a step of `batch` sequences over a `kv_dtype` pool: CAPPED_TILES' from CAPPED_FROM_BATCH,
    MIDDLE_TILES' from MIDDLE_FROM_BATCH (an e4m3 pool), else DECODE_TILES' (DecodeTile() for a 16-bit pool)."""
    if batch >= CAPPED_FROM_BATCH and kv_dtype in CAPPED_TILES:
        return CAPPED_TILES[kv_dtype]
    if batch >= MIDDLE_FROM_BATCH and kv_dtype in MIDDLE_TILES:
        return MIDDLE_TILES[kv_dtype]
    return DECODE_TILES.get(kv_dtype, DecodeTile())


# About four programs an SM on a 132-SM H200: at batch 64 two splits of the context beat one by 14%
# (1k tokens) and 18% (4k), at batch 32 four beat two by 4% and 15% (`python -m bench.micro.decode_attention`)
TARGET_PROGRAMS = 528
# At most 32 slices a sequence: at batches 1-2, 32 splits beat 64 at every context of 1-4k tokens, both pools
# (bf16 pool, batch 1: 5.6 against 6.2 us a layer at 1k, 9.3 against 10.0 at 4k; e4m3: 6.2 against 6.7 and
# 7.7 against 9.5; bench/results/decode-attention-b1-splits-*-h200.json)
MAX_SPLITS = 32
MERGE_ROWS_WARPS = 8  # the merge of a sequence's heads: one program holds 28 x 128 float32 sums


@triton.jit
def _split_len(ctx, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens in each of a sequence's context slices: equal slices, whole steps, at least one step."""
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _rotated(ROW, heads, mask, offs_d, c, s, HEAD_DIM: tl.constexpr):
    """Rows `heads` of one token's projection, q * cos + rotate_half(q) * sin, each product and the
    sum rounded to the model dtype as in PyTorch (and `engine.kernels.fused`'s rope kernel)."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(ROW + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    partner = tl.load(ROW + heads[:, None] * HEAD_DIM + ((offs_d + half) % HEAD_DIM)[None, :], mask=mask, other=0.0)
    dt = x.dtype
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    return ((x.to(tl.float32) * c[None, :]).to(dt).to(tl.float32)
            + (sign * partner.to(tl.float32) * s[None, :]).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _e4m3_words_to_f16(words, HEAD_DIM: tl.constexpr, ASM: tl.constexpr):
    """[N, D / 4] 32-bit words of four e4m3 values each -> [N, D] float16 (exact), converted in the words'
    own layout. Converted in the PV product's operand layout instead (`.to` on the loaded tile), each
    thread gathered single bytes of consecutive tokens from shared memory: 64 byte loads a warp a step,
    the most of a step's instructions (sm_90 SASS); in float16 the operand is one transposing load.
    K converted the same way saves a little more (`python -m bench.micro.kernel_sass`: 795 a warp a step,
    640 with V's words, 590 with K's too, at the capped tile). ASM: the conversion instruction, two values
    at a time (a GPU); else each byte shifted out and read as e4m3 (Triton's interpreter, which runs no
    inline assembly), the same values in the same order."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 d0, d1; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 d0, lo; "
            "cvt.rn.f16x2.e4m3x2 d1, hi; mov.b32 {$0, $1}, d0; mov.b32 {$2, $3}, d1; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)
    else:  # little-endian: a word's first byte is the lowest dim
        b0 = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b1 = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b2 = ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        b3 = ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [words.shape[0], HEAD_DIM])  # bytes in order


@triton.jit
def _split_kernel(Q, KV, BT, BT_STRIDE, CTX, OUT, ML, RESULT, POS, COS, SIN, SLOTS,
                  s_qb, s_qh, s_kv_kind, s_kv_slot, s_kv_head, s_bt, s_ob, s_oh, s_os, s_mb, s_mh, s_ms,
                  s_rb, s_rh, s_cos, scale_log2,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, ROPE: tl.constexpr,
                  STRIDE_ON_DEVICE: tl.constexpr, PRECISION: tl.constexpr, F16_MMA: tl.constexpr,
                  E4M3_WORDS: tl.constexpr, WORDS_ASM: tl.constexpr,
                  PDL: tl.constexpr):
    # The step's metadata and the rope tables are written before the step starts and by no kernel in
    # it: read while the kernel before drains, then wait for it (engine.kernels.launch) to read q.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    if STRIDE_ON_DEVICE:  # packed tables whose row length changes step to step (CUDA graphs)
        s_bt = tl.load(BT_STRIDE)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b)
    split_len = _split_len(ctx, NUM_SPLITS, BLOCK_N)
    start = split * split_len
    if start >= ctx:  # a slice past the context (short contexts leave most empty): the merge reads none of them
        return
    end = tl.minimum(start + split_len, ctx)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    if ROPE:
        pos = tl.load(POS + b).to(tl.int64)
        c = tl.load(COS + pos * s_cos + offs_d)
        s = tl.load(SIN + pos * s_cos + offs_d)
    if PDL:
        gdc_wait()
    if ROPE:  # Q is the qkv projection [B, (H + 2 Hkv) D]: rotate as loaded
        row = Q + b * s_qb
        c = c.to(Q.dtype.element_ty).to(tl.float32)
        s = s.to(Q.dtype.element_ty).to(tl.float32)
        q = _rotated(row, heads, gmask[:, None], offs_d, c, s, HEAD_DIM)
        if split == tl.cdiv(ctx, split_len) - 1:  # the slice ends at the new token: store its K and V first
            one = offs_g < 1
            k_new = _rotated(row, NUM_HEADS + kvh + offs_g * 0, one[:, None], offs_d, c, s, HEAD_DIM)
            v_new = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + offs_d)
            slot = tl.load(SLOTS + b).to(tl.int64)
            dst = KV + slot * s_kv_slot + kvh * s_kv_head
            # an e4m3 pool: Triton converts to it from float32 only (exact for a 16-bit pool)
            tl.store(dst + offs_g[:, None] * 0 + offs_d[None, :], k_new.to(tl.float32).to(KV.dtype.element_ty),
                     mask=one[:, None])
            tl.store(dst + s_kv_kind + offs_d, v_new.to(tl.float32).to(KV.dtype.element_ty))
            tl.debug_barrier()  # this program's loads below see them
    else:
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    if F16_MMA:  # e4m3 K and V to float16 take one conversion a pair of values, to bfloat16 three
        q = q.to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for t0 in tl.range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        block = tl.load(BT + b * s_bt + offs_n // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        base = KV + slot[:, None] * s_kv_slot + kvh * s_kv_head + offs_d[None, :]
        if E4M3_WORDS:  # K and V as 32-bit words (four e4m3 values of a token), to float16 before the operands' layout
            rows = (KV + slot * s_kv_slot + kvh * s_kv_head).to(tl.pointer_type(tl.int32), bitcast=True)
            words = rows[:, None] + tl.arange(0, HEAD_DIM // 4)[None, :]
            k = _e4m3_words_to_f16(tl.load(words, mask=valid[:, None], other=0), HEAD_DIM, WORDS_ASM).to(q.dtype)
            v = _e4m3_words_to_f16(tl.load(words + s_kv_kind // 4, mask=valid[:, None], other=0), HEAD_DIM,
                                   WORDS_ASM).to(q.dtype)
        else:
            k = tl.load(base, mask=valid[:, None], other=0.0).to(q.dtype)
            v = tl.load(base + s_kv_kind, mask=valid[:, None], other=0.0).to(q.dtype)
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
    if NUM_SPLITS == 1:
        result = RESULT + b * s_rb + heads[:, None] * s_rh + offs_d[None, :]
        tl.store(result, (acc / l_i[:, None]).to(RESULT.dtype.element_ty), mask=gmask[:, None])
    else:
        out_ptr = OUT + b * s_ob + heads[:, None] * s_oh + split * s_os + offs_d[None, :]
        tl.store(out_ptr, acc, mask=gmask[:, None])
        ml_ptr = ML + b * s_mb + heads * s_mh + split * s_ms
        tl.store(ml_ptr, m_i, mask=gmask)
        tl.store(ml_ptr + 1, l_i, mask=gmask)


@triton.jit
def _merge_kernel(OUT, ML, RESULT, CTX, s_ob, s_oh, s_os, s_mb, s_mh, s_ms, s_Ob, s_Oh,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(CTX + b)  # the step's metadata: no kernel writes it, so read before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    split_len = _split_len(ctx, NUM_SPLITS, BLOCK_N)
    offs_s = tl.arange(0, NUM_SPLITS)
    used = offs_s < tl.cdiv(ctx, split_len)  # the slices past the context hold nothing: not read
    offs_d = tl.arange(0, HEAD_DIM)
    ml = ML + b * s_mb + h * s_mh + offs_s * s_ms
    m = tl.load(ml, mask=used, other=float("-inf"))
    lsum = tl.load(ml + 1, mask=used, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(lsum > 0, tl.exp2(m - m_max), 0.0)
    parts = tl.load(OUT + b * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_d[None, :], mask=used[:, None],
                    other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(RESULT + b * s_Ob + h * s_Oh + offs_d, o.to(RESULT.dtype.element_ty))


@triton.jit
def _merge_rows_kernel(OUT, ML, RESULT, CTX, Q8, SCALE, s_ob, s_oh, s_os, s_mb, s_mh, s_ms, s_Ob, s_Oh, s_q8,
                       HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, BOUND: tl.constexpr, PDL: tl.constexpr):
    """The merge of a sequence's every head in one program, which then has the whole row: it also
    writes the row's e4m3 values and scale (`fp8_quant.quantize_rows`' bits of the stored row, the
    scale bounded by BOUND where o_proj has an `input_bound`), the x of a W8A8 o_proj. The slices are
    added in split order."""
    b = tl.program_id(0)
    ctx = tl.load(CTX + b)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    slices = tl.cdiv(ctx, _split_len(ctx, NUM_SPLITS, BLOCK_N))  # those past the context hold nothing: not read
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < HEADS
    ml = ML + b * s_mb + offs_h * s_mh
    m_max = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    for i in range(NUM_SPLITS):
        ok = head_ok & (offs_h * 0 + i < slices)
        m_max = tl.maximum(m_max, tl.load(ml + i * s_ms, mask=ok, other=float("-inf")))
    acc = tl.zeros([HEADS_PAD, HEAD_DIM], dtype=tl.float32)
    den = tl.zeros([HEADS_PAD], dtype=tl.float32)
    for i in range(NUM_SPLITS):
        ok = head_ok & (offs_h * 0 + i < slices)
        lsum = tl.load(ml + i * s_ms + 1, mask=ok, other=0.0)
        w = tl.where(lsum > 0, tl.exp2(tl.load(ml + i * s_ms, mask=ok, other=float("-inf")) - m_max), 0.0)
        part = tl.load(OUT + b * s_ob + offs_h[:, None] * s_oh + i * s_os + offs_d[None, :], mask=ok[:, None],
                       other=0.0)
        acc += part * w[:, None]
        den += lsum * w
    o = (acc / tl.where(head_ok, den, 1.0)[:, None]).to(RESULT.dtype.element_ty)
    tl.store(RESULT + b * s_Ob + offs_h[:, None] * s_Oh + offs_d[None, :], o, mask=head_ok[:, None])
    row = tl.arange(0, HEADS_PAD * HEAD_DIM)  # the row as o_proj reads it: head after head
    store_e4m3_row(tl.reshape(o.to(tl.float32), [HEADS_PAD * HEAD_DIM]), Q8 + b * s_q8 + row, SCALE + b,
                   row < HEADS * HEAD_DIM, BOUND)


def num_splits_for(batch: int, num_kv_heads: int) -> int:
    splits = max(1, TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(splits))


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, block_size: int,
                           table_stride: torch.Tensor | None = None, splits: int | None = None,
                           tile: DecodeTile | None = None, e4m3_rows: bool = False,
                           e4m3_bound: float | None = None) -> tuple[torch.Tensor, E4m3Rows | None]:
    """q [B, H, D]; kv_layer [2, slots, Hkv, D]; block_tables [B, max_blocks] int32 with unit column
    stride; context_lens [B] int32 -> ([B, H, D], None). `table_stride` (a device int32 scalar), when
    given, overrides the tables' row stride; `splits` the context splits `num_splits_for` picks, `tile`
    the one `decode_tile` picks; `e4m3_rows` and `e4m3_bound` as `paged_decode_attention_rope`'s. Shapes
    only, no host sync: safe inside a CUDA graph."""
    return _attend(q, q.shape[1], None, kv_layer, block_tables, context_lens, block_size, table_stride, splits,
                   tile, e4m3_rows, e4m3_bound)


def paged_decode_attention_rope(qkv: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, slots: torch.Tensor, kv_layer: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                table_stride: torch.Tensor | None = None, splits: int | None = None,
                                e4m3_rows: bool = False,
                                e4m3_bound: float | None = None) -> tuple[torch.Tensor, E4m3Rows | None]:
    """`ops.rope_and_store` then `paged_decode_attention` for a decode step, in one kernel: qkv
    [B, (H + 2 Hkv) D] unrotated, positions and slots [B] of each sequence's new token (the last
    of its context_lens), cos and sin the float32 tables [positions, D]. Returns ([B, H, D], None);
    with `e4m3_rows`, where the context is split, the merge takes each sequence's heads in one
    program and the second is the result's rows in e4m3 (`quantize_rows(rows, e4m3_bound)`' bits:
    o_proj's W8A8 x)."""
    assert qkv.stride(1) == 1 and cos.stride() == sin.stride()
    return _attend(qkv, num_heads, (positions, cos, sin, slots), kv_layer, block_tables, context_lens, block_size,
                   table_stride, splits, None, e4m3_rows, e4m3_bound)


def _attend(q: torch.Tensor, heads: int, rope: tuple[torch.Tensor, ...] | None, kv_layer: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
            table_stride: torch.Tensor | None, splits: int | None, tile: DecodeTile | None,
            e4m3_rows: bool = False, e4m3_bound: float | None = None) -> tuple[torch.Tensor, E4m3Rows | None]:
    batch, dim = q.shape[0], kv_layer.shape[3]
    tile = tile or decode_tile(kv_layer.dtype, batch)
    kv_heads = kv_layer.shape[2]
    group = heads // kv_heads
    splits = splits or num_splits_for(batch, kv_heads)
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    partial = ml = out
    if splits > 1:
        partial = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    positions, cos, sin, slots = rope if rope is not None else (context_lens,) * 4
    scale_log2 = (dim ** -0.5) * 1.4426950408889634
    e4m3 = kv_layer.dtype == torch.float8_e4m3fn
    words = e4m3 and tile.word_loads
    assert not words or (dim % 4 == 0 and kv_layer.data_ptr() % 4 == 0
                         and all(s % 4 == 0 for s in kv_layer.stride()[:3])), "e4m3 KV rows must be word-aligned"
    s_part = (partial.stride(0), partial.stride(1), partial.stride(2)) if splits > 1 else (0, 0, 0)
    s_ml = (ml.stride(0), ml.stride(1), ml.stride(2)) if splits > 1 else (0, 0, 0)
    _split_kernel[(batch, kv_heads, splits)](
        q, kv_layer, block_tables, table_stride if table_stride is not None else context_lens, context_lens,
        partial, ml, out, positions, cos, sin, slots,
        q.stride(0), dim if rope is not None else q.stride(1), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), block_tables.stride(0), *s_part, *s_ml, out.stride(0), out.stride(1),
        cos.stride(0) if rope is not None else 0, scale_log2,
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim, BLOCK_SIZE=block_size, BLOCK_N=tile.block_n, NUM_SPLITS=splits, ROPE=rope is not None,
        STRIDE_ON_DEVICE=table_stride is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 models: no TF32 rounding
        # an e4m3 pool under bfloat16 q: the products in float16, which holds every e4m3 value and every
        # bfloat16 one from 2^-14 to 65504 exactly; the sums are float32 either way
        F16_MMA=e4m3 and q.dtype == torch.bfloat16,
        E4M3_WORDS=words, WORDS_ASM=kv_layer.is_cuda,  # Triton's interpreter runs kernels on CPU tensors
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch.options(tile.max_registers))
    if splits == 1:
        return out, None
    if not e4m3_rows:
        _merge_kernel[(batch, heads)](
            partial, ml, out, context_lens, *s_part, *s_ml, out.stride(0), out.stride(1), HEAD_DIM=dim,
            BLOCK_N=tile.block_n, NUM_SPLITS=splits, num_warps=4, **launch.options())
        return out, None
    q8 = torch.empty(batch, heads * dim, dtype=torch.float8_e4m3fn, device=q.device)
    scale = torch.empty(batch, 1, dtype=torch.float32, device=q.device)
    _merge_rows_kernel[(batch,)](
        partial, ml, out, context_lens, q8, scale, *s_part, *s_ml, out.stride(0), out.stride(1), q8.stride(0),
        HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HEAD_DIM=dim, BLOCK_N=tile.block_n, NUM_SPLITS=splits,
        BOUND=e4m3_bound or 0.0, num_warps=MERGE_ROWS_WARPS, **launch.options())
    return out, (q8, scale)
