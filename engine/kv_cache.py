"""The KV cache: its layout (shared by both servers byte for byte), and a paged pool of blocks.

Pool storage is one tensor `[num_layers, 2, num_slots, num_kv_heads, head_dim]` (K then V), where
slot = block * block_size + offset. A sequence owns a list of blocks (its block table); token t
lives in slot `table[t // block_size] * block_size + t % block_size`.

On the wire (every transport) one layer's KV for tokens [a, b) is K[a:b] then V[a:b], each
`[b - a, num_kv_heads, head_dim]`, contiguous, in the layout's dtype (`SHAPE_ORDER`).

The layout's dtype is the model's, or e4m3 (`--kv-cache-dtype fp8`): half the bytes in the pool and
on every transport. Its scale is 1.0 (values saturate at e4m3's largest, 448); writers round K and V
to it (`to_kv_dtype`), readers convert back to the model dtype as they load.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.device import DTYPES
from engine.model_config import ModelConfig

SHAPE_ORDER = "layer,kv,token,head,dim"
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_KV_MAX = 448.0  # e4m3's largest finite value: K and V saturate there (scale 1.0)


def to_kv_dtype(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V rounded to the pool's dtype; e4m3 saturates (PyTorch's cast would give NaN past 448)."""
    if kv.dtype == dtype:
        return kv
    if dtype == torch.float8_e4m3fn:
        kv = kv.clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return kv.to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-byte (e4m3) KV tensor as uint8, for the copies PyTorch does not implement for float8 on
    the CPU (index_copy_, index_select); other dtypes as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@dataclass(frozen=True)
class KVLayout:
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    shape_order: str = SHAPE_ORDER

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype, block_size: int,
                  kv_scales: tuple[tuple[float, float], ...] = ()) -> KVLayout:
        """`kv_scales`: a checkpoint's (k_scale, v_scale) a layer, folded into its weights, so the pool holds
        K / k_scale and V / v_scale: they name the layout too, and a peer that folded others (or none)
        is refused at pairing instead of reading the KV at the wrong scale."""
        name = next((n for n, d in KV_DTYPES.items() if d == dtype), None)
        if name is None:
            raise ValueError(f"unsupported KV dtype {dtype}")
        model = config.fingerprint()
        if kv_scales:
            model += "-kv-scales-" + hashlib.sha256(json.dumps(kv_scales).encode()).hexdigest()[:8]
        return cls(model, name, config.num_layers, config.num_kv_heads, config.head_dim, block_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]

    @property
    def bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    def mismatch(self, other: KVLayout) -> str | None:
        """A one-line description of how `other` differs, or None when they agree.

        block_size is each side's own choice (the wire format is per token), so it may differ.
        """
        diffs = [
            f"{field}: ours {getattr(self, field)!r}, theirs {getattr(other, field)!r}"
            for field in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim", "shape_order")
            if getattr(self, field) != getattr(other, field)
        ]
        return "; ".join(diffs) or None


class OutOfBlocks(Exception):
    """The pool has too few free blocks for the request right now."""


class BlockAllocator:
    """Free blocks kept as sorted runs of consecutive ids. Thread-safe: the engine thread and the
    gRPC loop both use it.

    A request gets the lowest run long enough for all its blocks when there is one, so a prompt's
    KV is usually one slice of the pool; cuda-ipc then copies it without gathering or scattering
    (`KVPool.table_start`). With no such run the blocks come from the lowest runs."""

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        self.num_blocks = num_blocks - first
        self._runs: list[list[int]] = [[first, num_blocks - first]] if num_blocks > first else []  # [start, length]
        self._num_free = self.num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > self._num_free:
                raise OutOfBlocks(f"need {n} KV blocks, {self._num_free} of {self.num_blocks} free")
            self._num_free -= n
            fit = next((i for i, (_, length) in enumerate(self._runs) if length >= n), None)
            if fit is not None:
                return self._take(fit, n)
            blocks: list[int] = []
            while len(blocks) < n:
                blocks += self._take(0, min(n - len(blocks), self._runs[0][1]))
            return blocks

    def _take(self, i: int, n: int) -> list[int]:
        start, length = self._runs[i]
        if n == length:
            del self._runs[i]
        else:
            self._runs[i] = [start + n, length - n]
        return list(range(start, start + n))

    def free(self, blocks: list[int]) -> None:
        if not blocks:
            return
        ids = sorted(blocks)
        with self._lock:
            self._num_free += len(ids)
            run_start = prev = ids[0]
            for b in ids[1:] + [-1]:
                if b != prev + 1:
                    self._insert(run_start, prev - run_start + 1)
                    run_start = b
                prev = b

    def _insert(self, start: int, length: int) -> None:
        """Add a free run, merged with the runs it touches."""
        i = bisect.bisect_left(self._runs, [start, 0])
        if i < len(self._runs) and self._runs[i][0] == start + length:
            length += self._runs.pop(i)[1]
        if i > 0 and sum(self._runs[i - 1]) == start:
            self._runs[i - 1][1] += length
        else:
            self._runs.insert(i, [start, length])


def run_start(block_table: list[int], num_tokens: int, block_size: int, start: int = 0) -> int | None:
    """The first slot when tokens [start, num_tokens) of a sequence with this block table are one
    ascending run of slots (then they are plain slices of its pool), else None. Host only."""
    first_block, n = start // block_size, -(-num_tokens // block_size)
    if n <= first_block or start >= num_tokens or len(block_table) < n:
        return None
    first = block_table[first_block]
    if block_table[first_block:n] != list(range(first, first + n - first_block)):
        return None
    return first * block_size + start % block_size


def long_tensor(values: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """Integers as a host int64 tensor. Python ints go through an array's buffer (a 32k-token
    prompt takes 0.6 ms where `torch.tensor` takes 2.5, 2-core CPU); a numpy array, or a protobuf
    repeated field (which numpy reads in one copy), through numpy."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.long)
    if not len(values):
        return torch.empty(0, dtype=torch.long)
    if isinstance(values, list | tuple | range):
        return torch.frombuffer(array("q", values), dtype=torch.long)
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def slot_ids(block_table: Sequence[int] | torch.Tensor, start: int, end: int, block_size: int,
             device: torch.device | None = None) -> torch.Tensor:
    """Slot ids of tokens [start, end) of a sequence with this block table, computed on `device`
    (default the host) from the blocks that hold them: a few thousand block ids go to the device,
    not one slot id per token."""
    first, last = start // block_size, -(-end // block_size)
    if end > start and len(block_table) < last:  # checked here: on a GPU the index would kill the context
        raise IndexError(f"tokens [{start}, {end}) need {last} blocks; the table has {len(block_table)}")
    blocks = long_tensor(block_table[first:last]).to(device or "cpu", non_blocking=True)
    pos = torch.arange(start, end, dtype=torch.long, device=blocks.device)
    return blocks[pos // block_size - first] * block_size + pos % block_size


def raw_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of plain integers (numpy has no bfloat16)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.uint8).numpy()


class KVPool:
    """Preallocated paged KV storage for every layer, plus its block allocator."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, reserved_blocks: int = 0) -> None:
        """`reserved_blocks` at the start are never handed out: padded rows of a CUDA-graph batch
        write their (ignored) KV there."""
        if num_blocks <= reserved_blocks:
            raise ValueError("the KV pool needs at least one block")
        self.layout = layout
        self.device = device
        self.num_blocks = num_blocks
        self.num_slots = num_blocks * layout.block_size
        # One allocation for every layer, so the cuda-ipc transport exports the pool with one handle.
        self.storage = torch.zeros(layout.num_layers, 2, self.num_slots, layout.num_kv_heads, layout.head_dim,
                                   dtype=layout.torch_dtype, device=device)
        self.layers = list(self.storage.unbind(0))
        self.allocator = BlockAllocator(num_blocks, first=reserved_blocks)

    @staticmethod
    def blocks_for_memory(layout: KVLayout, memory_bytes: int) -> int:
        return max(0, memory_bytes // (layout.bytes_per_token * layout.block_size))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def slots(self, block_table: list[int] | torch.Tensor, start: int, end: int) -> torch.Tensor:
        """`slot_ids` in this pool's block size, on the pool's device."""
        return slot_ids(block_table, start, end, self.layout.block_size, self.device)

    def table_start(self, block_table: list[int], num_tokens: int, start: int = 0) -> int | None:
        """`run_start` in this pool's block size."""
        return run_start(block_table, num_tokens, self.layout.block_size, start)

    def run(self, layer: int, first: int, n: int) -> torch.Tensor:
        """K and V of the `n` slots from `first` in wire order, `[2, n, num_kv_heads, head_dim]`: a
        view of the pool, whose K and V halves are each contiguous."""
        return self.layers[layer].narrow(1, first, n)

    def read(self, layer: int, slots: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """K and V of `slots` in wire order: `[2, len(slots), num_kv_heads, head_dim]`; a view when
        `first` says the slots are one run starting there."""
        if first is not None:
            return self.run(layer, first, slots.numel())
        return as_bytes(self.layers[layer]).index_select(1, slots).view(self.layout.torch_dtype)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, first: int | None = None) -> None:
        """Store wire-ordered `[2, n, num_kv_heads, head_dim]` at `slots`."""
        if first is not None:
            dst = self.run(layer, first, slots.numel())
            if dst.is_cpu and kv.is_cpu and kv.dtype == dst.dtype and kv.stride(-1) == 1:
                # one memcpy per half on this thread: torch's copy fans out to its intra-op threads,
                # and runs at half speed while a receiver's gRPC threads hold the other cores
                np.copyto(raw_view(dst), raw_view(kv))
            else:
                dst.copy_(kv)
        else:
            as_bytes(self.layers[layer]).index_copy_(1, slots, as_bytes(kv))

    def write_layers(self, start: int, end: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store layers [start, end) at once from `[end - start, 2, n, num_kv_heads, head_dim]`: one
        device call for several layers (the NCCL receiver's scatter, where the slots are not one run)."""
        as_bytes(self.storage[start:end]).index_copy_(2, slots, as_bytes(kv))
