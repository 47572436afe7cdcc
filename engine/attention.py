"""Attention over the paged KV pool: prefill (one sequence, a chunk of new tokens after `start`
cached ones) and decode (many sequences, one new token each).

A prefill's new K and V are in the pool before its attention (`ops.rope_and_store`); a decode
step's attention writes them itself. Decode on CUDA rotates, writes and reads the pool in place
through one Triton kernel (`engine.kernels.paged_decode`); the gather path here is the reference
and the CPU path.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from engine import attention_fp8
from engine.kv_cache import KVPool, as_bytes
from engine.ops import Activations, QuantizedRows, expand_kv, rope_and_store


def attention_rows(tokens: int, device: torch.device) -> int:
    """Rows a whole prompt's attention runs on. cuDNN builds an execution plan for every new shape
    (50-60 ms on an H200, `bench.micro.attention --new-lengths`), so on CUDA prompts are padded to one of
    eight lengths per octave (at most 12.5% more rows; powers of two exactly): a server meets a
    bounded set of shapes and builds their plans once (`prepare_prefill_plans`). Causal attention
    leaves the real rows untouched by the zero rows after them."""
    if device.type != "cuda":
        return tokens
    step = max(16, 1 << max(0, (tokens - 1).bit_length() - 4))
    return -(-tokens // step) * step


@dataclass
class PrefillMeta:
    new_slots: torch.Tensor            # [T] long: where the chunk's KV goes
    prior_slots: torch.Tensor | None   # [start] long: the sequence's cached tokens, or None at start 0

    @property
    def whole_prompt(self) -> bool:
        """No cached prefix: attention takes q, k, v padded to `rows` (ops.rope_and_store)."""
        return self.prior_slots is None or self.prior_slots.numel() == 0

    @property
    def rows(self) -> int:
        return attention_rows(self.new_slots.numel(), self.new_slots.device)


@dataclass
class DecodeMeta:
    new_slots: torch.Tensor     # [B] long: where each sequence's new token's KV goes
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [B] int32, including the new token
    max_context: int            # host-side bound on context_lens (sizes the gather path)
    use_kernel: bool = False    # Triton paged kernel (CUDA only)
    table_stride: torch.Tensor | None = None  # device scalar: the tables' row stride (packed, graphs)


# Whole-prompt prefill on Hopper: cuDNN's attention is the fastest PyTorch has; flash next.
_PREFILL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                      meta: PrefillMeta) -> torch.Tensor:
    """Causal attention of a prefill chunk (q [T, H, D], k/v [T, Hkv, D]) -> [T, H, D]. A whole
    prompt comes padded to `meta.rows` and runs token-major with grouped KV heads as they are
    (cuDNN's fastest layout at this shape, `bench.micro.attention --new-lengths`); a chunk after a cached
    prefix reads the prefix from the pool."""
    if meta.whole_prompt:
        return whole_prompt_attention(q, k, v, fp8=fp8_prefill(pool, q.device))[:meta.new_slots.numel()]
    k, v = _with_prefix(k, v, pool, layer, meta)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D], [1, Hkv, L, D]
    mask = causal_lower_right(qh.shape[2], kh.shape[2])
    if not _flash_takes_grouped_heads(qh, kh, vh):
        # repeated for each query head: the other kernels of a lower-right mask take as many KV heads as q's
        groups = qh.shape[1] // kh.shape[1]
        kh, vh = expand_kv(kh, groups), expand_kv(vh, groups)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=kh.shape[1] != qh.shape[1])
    return out.squeeze(0).transpose(0, 1)


def _flash_takes_grouped_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash attention runs a chunk's lower-right causal attention with K and V's own heads:
    then nothing copies them once for each query head (at a 16k prefix, 0.9 GB a layer of a 7B)."""
    return q.is_cuda and torch.backends.cuda.can_use_flash_attention(
        torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, True))


def _with_prefix(k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                 meta: PrefillMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's k/v [T, Hkv, D] after its sequence's cached prefix, read from the pool."""
    cached = pool.read(layer, meta.prior_slots).to(k.dtype)  # type: ignore[arg-type]
    return torch.cat((cached[0], k)), torch.cat((cached[1], v))


# One query row: no cuDNN (it would build a plan for every key length); flash takes grouped KV heads.
_ROW_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def last_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                       meta: PrefillMeta) -> torch.Tensor:
    """Attention of a prefill chunk's last row alone (q [1, H, D]) over every key up to it: the
    cached prefix and the chunk's own k/v [T, Hkv, D]. The last row sees them all, so no mask."""
    if not meta.whole_prompt:
        k, v = _with_prefix(k, v, pool, layer, meta)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with sdpa_kernel(_ROW_BACKENDS) if qh.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def fp8_prefill(pool: KVPool, device: torch.device) -> bool:
    """Whether whole prompts attend on FP8 tensor cores: an e4m3 pool on a GPU that has them
    (`engine.attention_fp8`)."""
    return pool.layout.torch_dtype == torch.float8_e4m3fn and _fp8_available(device)


@functools.cache
def _fp8_available(device: torch.device) -> bool:
    return attention_fp8.available(device)


def whole_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: bool = False) -> torch.Tensor:
    """Causal attention over q [T, H, D], k/v [T, Hkv, D] from position 0 -> [T, H, D]; with `fp8`
    (16-bit q, k, v on a GPU with FP8 tensor cores) and at least `attention_fp8.MIN_ROWS` rows, in e4m3
    through `attention_fp8`."""
    rows, heads, dim = q.shape
    if (fp8 and rows >= attention_fp8.MIN_ROWS and q.dtype in (torch.bfloat16, torch.float16)
            and attention_fp8.supports(rows, heads, k.shape[1], dim, q.device)):
        return attention_fp8.fp8_causal_attention(q, k, v)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views of [T, H, D]
    if qh.is_cuda and qh.dtype == torch.float32:
        # cuDNN and flash take 16-bit only, and the memory-efficient kernel no grouped heads; left
        # to itself SDPA would fall back to the math path, which holds [H, T, T] scores (30 GB at 16k)
        groups = qh.shape[1] // kh.shape[1]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(qh, expand_kv(kh, groups), expand_kv(vh, groups), is_causal=True)
        return out.squeeze(0).transpose(0, 1)
    with sdpa_kernel(_PREFILL_BACKENDS, set_priority=True) if qh.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def prepare_prefill_plans(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device, max_tokens: int, fp8: bool = False) -> int:
    """Build cuDNN's plan for every whole-prompt length bucket up to `max_tokens` on this thread
    (PyTorch caches cuDNN plans per thread, `attention_fp8` too); returns how many. `fp8`: the plans of
    FP8 attention (`fp8_prefill`)."""
    if device.type != "cuda":
        return 0
    buckets = sorted({attention_rows(n, device) for n in range(1, max_tokens + 1)})
    for rows in buckets:
        q = torch.zeros(rows, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device)
        whole_prompt_attention(q, kv, kv, fp8=fp8)
    torch.cuda.synchronize(device)
    return len(buckets)


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pool: KVPool, layer: int, meta: DecodeMeta, num_heads: int, num_kv_heads: int,
                     head_dim: int, e4m3_rows: bool = False, e4m3_bound: float | None = None) -> Activations:
    """A decode step's rope, KV write and attention: qkv [B, (H + 2 Hkv) D] unrotated (one new token
    per sequence) -> [B, H * D]. With `meta.use_kernel` one Triton kernel does all three; otherwise
    `ops.rope_and_store`, then the gather path. `e4m3_rows` (o_proj takes x in e4m3): where the
    kernel's merge can write them too, the rows come with their e4m3 values (`QuantizedRows`), their
    scales bounded by `e4m3_bound` (o_proj's `input_bound`)."""
    rows = qkv.shape[0]
    if meta.use_kernel:
        from engine.kernels.paged_decode import paged_decode_attention_rope

        out, e4m3 = paged_decode_attention_rope(qkv, num_heads, positions, cos, sin, meta.new_slots,
                                                pool.layers[layer], meta.block_tables, meta.context_lens,
                                                pool.layout.block_size, meta.table_stride, e4m3_rows=e4m3_rows,
                                                e4m3_bound=e4m3_bound)
        return out.view(rows, -1) if e4m3 is None else QuantizedRows(out.view(rows, -1), e4m3)
    q, _, _ = rope_and_store(qkv, positions, cos, sin, pool.layers[layer], meta.new_slots, num_heads, num_kv_heads,
                             head_dim)
    return gather_decode_attention(q, pool, layer, meta).reshape(rows, -1)


def gather_decode_attention(q: torch.Tensor, pool: KVPool, layer: int, meta: DecodeMeta) -> torch.Tensor:
    bs = pool.layout.block_size
    pos = torch.arange(meta.max_context, device=q.device)
    tables = meta.block_tables.long()
    slots = tables[:, pos // bs] * bs + pos % bs                       # [B, L]
    layer_kv = pool.layers[layer]
    if layer_kv.element_size() == 1:  # e4m3: gathered as bytes (no gather kernel takes float8), then read as e4m3
        kv = as_bytes(layer_kv)[:, slots].view(pool.layout.torch_dtype).to(q.dtype)  # [2, B, L, Hkv, D]
    else:
        kv = layer_kv[:, slots].to(q.dtype)
    groups = q.shape[1] // kv.shape[3]
    kh = expand_kv(kv[0].transpose(1, 2), groups)                      # [B, H, L, D]
    vh = expand_kv(kv[1].transpose(1, 2), groups)
    mask = (pos[None, :] < meta.context_lens[:, None]).view(q.shape[0], 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), kh, vh, attn_mask=mask)
    return out.squeeze(2)
