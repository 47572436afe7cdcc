"""KV over the gRPC stream itself: each layer in messages of about `chunk_bytes`.

Portable (CPU, any network) and the fallback; never unpickles anything: chunks are raw bytes in
the layout's dtype, checked against the layout's sizes on arrival.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import warnings
from collections.abc import Callable

import torch

from engine.kv_cache import KVLayout, KVPool, raw_view
from engine.transport.base import KVReceiver, KVSender

DEFAULT_CHUNK_BYTES = 8 << 20

# Chunks are only read (then copied into the pool), so a read-only view of the message is safe.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def keep_freed_memory() -> None:
    """Let glibc reuse freed KV messages instead of handing each back to the kernel: every fresh
    8 MB message otherwise page-faults in, which halves the gRPC transport's throughput.

    The trim threshold covers the main heap; the threads' arenas (gRPC's, the executors') unmap
    each 64 MB sub-heap as soon as it empties, whatever that threshold, unless the top pad is at
    least a sub-heap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 256 << 20)
    libc.mallopt(m_trim_threshold, 4 << 30)
    libc.mallopt(m_top_pad, 64 << 20)


def chunk_tokens_for(layout: KVLayout, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // layout.bytes_per_token_per_layer)


def tensor_parts(kv: torch.Tensor) -> list[memoryview]:
    """K then V of a `[2, n, heads, dim]` tensor as views of its memory (copied once, into the message)."""
    return [raw_view(kv[0].contiguous()).data, raw_view(kv[1].contiguous()).data]


class ChunkError(ValueError):
    """A KV chunk that does not fit the agreed layout or the request."""


def parse_chunk(layout: KVLayout, num_tokens: int, layer: int, start: int, end: int,
                data: bytes | memoryview) -> torch.Tensor:
    if not 0 <= layer < layout.num_layers or not 0 <= start < end <= num_tokens:
        raise ChunkError(f"KV chunk layer {layer} tokens [{start}, {end}) is outside the request "
                         f"({layout.num_layers} layers, {num_tokens} tokens)")
    expected = (end - start) * layout.bytes_per_token_per_layer
    if memoryview(data).nbytes != expected:
        raise ChunkError(f"KV chunk of {memoryview(data).nbytes} bytes, layout says {expected}")
    raw = torch.frombuffer(data, dtype=torch.uint8)
    return raw.view(layout.torch_dtype).view(2, end - start, layout.num_kv_heads, layout.head_dim)


class GrpcKVSender(KVSender):
    """Reads each finished layer out of the pool and emits (layer, start, end, bytes) pieces.

    On CUDA the device-to-host copy runs on a side stream into pinned memory, and a packing thread
    waits for it, so the prefill's later layers are not held up by the copies. `first`
    (`KVPool.table_start`) says the slots are one run: then a layer is read as plain slices.
    """

    def __init__(self, pool: KVPool, slots: torch.Tensor, chunk_tokens: int,
                 emit: Callable[[int, int, int, list[memoryview]], object], first: int | None = None) -> None:
        self.pool, self.slots, self.chunk_tokens, self.emit, self.first = pool, slots, chunk_tokens, emit, first
        self.cuda = pool.device.type == "cuda"
        self._pending: queue.Queue[tuple[int, torch.Tensor, object] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._packer: threading.Thread | None = None
        if self.cuda:
            self._stream = torch.cuda.Stream(pool.device)
            self._packer = threading.Thread(target=self._pack_loop, daemon=True, name="kv-pack")
            self._packer.start()

    def _emit_layer(self, layer: int, kv: torch.Tensor) -> None:
        n = kv.shape[1]
        for start in range(0, n, self.chunk_tokens):
            end = min(n, start + self.chunk_tokens)
            self.emit(layer, start, end, tensor_parts(kv[:, start:end]))

    def layer_done(self, layer: int) -> None:
        if not self.cuda:
            self._emit_layer(layer, self.pool.read(layer, self.slots, self.first))
            return
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            kv = self.pool.read(layer, self.slots)
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._pending.put((layer, host, copied))

    def _pack_loop(self) -> None:
        while (item := self._pending.get()) is not None:
            layer, host, copied = item
            try:
                copied.synchronize()  # type: ignore[attr-defined]
                self._emit_layer(layer, host)
            except BaseException as e:  # surfaced by finish()
                self._error = e

    def finish(self) -> None:
        if self._packer is not None:
            self._pending.put(None)
            self._packer.join()
        if self._error is not None:
            raise self._error


class GrpcKVReceiver(KVReceiver):
    """Writes arriving chunks into the decode pool at the request's slots, on the caller's thread
    (copies to a GPU pool are queued on its current stream). A chunk that does not fit the layout
    or the request raises `ChunkError`, before anything is written."""

    def __init__(self, pool: KVPool, block_table: list[int], num_tokens: int) -> None:
        self.pool, self.num_tokens = pool, num_tokens
        self.slots = pool.slots(block_table, 0, num_tokens)
        self.first = pool.table_start(block_table, num_tokens)  # from the table: no read of the device slots
        self.bytes_received = 0
        self._covered = [0] * pool.layout.num_layers

    def write(self, layer: int, start: int, end: int, data: bytes | memoryview) -> None:
        kv = parse_chunk(self.pool.layout, self.num_tokens, layer, start, end, data)
        first = None if self.first is None else self.first + start
        self.pool.write(layer, self.slots[start:end], kv.to(self.pool.device, non_blocking=True), first)
        self.bytes_received += memoryview(data).nbytes
        self._covered[layer] += end - start

    def complete(self) -> bool:
        return all(c == self.num_tokens for c in self._covered)
