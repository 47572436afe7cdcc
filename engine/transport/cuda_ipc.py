"""KV over CUDA IPC (same host, both GPUs visible to both processes): the decode side maps the
prefill server's whole KV pool once, at the handshake, and copies each request's KV straight
out of it over NVLink, layer by layer as the prefill side reports each layer done. The prefill
side keeps the request's blocks until the decode side acknowledges the copy (Release).

The CUDA driver API is called through ctypes; handles are 64 raw bytes, never pickled.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_cache import KVLayout, KVPool, as_bytes, run_start, slot_ids
from engine.transport.base import KVReceiver, KVSender

_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # c_char would cut the bytes at the first NUL


class IpcError(RuntimeError):
    pass


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise IpcError(f"{what} failed with CUDA driver error {result}")


def export_pool(pool: KVPool) -> tuple[bytes, int]:
    """(IPC handle of the allocation holding the pool, the pool's byte offset in it)."""
    lib = _driver()
    ptr = ctypes.c_uint64(pool.storage.data_ptr())
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
    handle = _IpcHandle()
    _check(lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(base.value)), "cuIpcGetMemHandle")
    return bytes(handle.reserved), pool.storage.data_ptr() - base.value


@dataclass
class _DeviceArray:
    """Just enough of __cuda_array_interface__ for torch.as_tensor to wrap a raw device pointer."""

    ptr: int
    shape: tuple[int, ...]
    itemsize: int = 2

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": self.shape, "typestr": f"<i{self.itemsize}", "data": (self.ptr, False), "strides": None,
                "version": 3}


class RemotePool:
    """The decode side's view of a prefill server's pool (opened once per pairing)."""

    def __init__(self, layout: KVLayout, handle: bytes, offset: int, num_slots: int, device: torch.device) -> None:
        itemsize = layout.torch_dtype.itemsize
        if itemsize not in (1, 2):
            raise IpcError("cuda-ipc moves 1- and 2-byte KV dtypes (bfloat16, float16, float8_e4m3fn)")
        lib = _driver()
        torch.cuda.set_device(device)
        if len(handle) != 64:
            raise IpcError(f"a CUDA IPC handle has 64 bytes, got {len(handle)}")
        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, 64)
        self._base = ctypes.c_uint64()
        open_fn = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        _check(open_fn(ctypes.byref(self._base), raw, ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS)),
               "cuIpcOpenMemHandle")
        shape = (layout.num_layers, 2, num_slots, layout.num_kv_heads, layout.head_dim)
        words = torch.as_tensor(_DeviceArray(self._base.value + offset, shape, itemsize), device=device)
        self.storage = words.view(layout.torch_dtype)
        self.block_size = layout.block_size
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _driver().cuIpcCloseMemHandle(ctypes.c_uint64(self._base.value))


class IpcKVSender(KVSender):
    """Prefill side: reports layers once their KV is written (a side thread waits on each layer's
    event, so the prefill never stalls); the KV itself stays in the pool for the decode side.
    A report of layer l says layers 0..l are written: layers already done when one is reported go
    in that one report, since each report costs this process a GIL hop (bench/NOTES.md).
    A cancelled request stops at the worker's check before the next layer (`cancellable`)."""

    def __init__(self, report: Callable[[int], object]) -> None:
        self.report = report
        self._events: queue.Queue[tuple[int, torch.cuda.Event] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ipc-report")
        self._thread.start()

    def layer_done(self, layer: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self._events.put((layer, event))

    def _loop(self) -> None:
        held: list[tuple[int, torch.cuda.Event] | None] = []  # taken from the queue, not yet done
        while True:
            item = held.pop() if held else self._events.get()
            if item is None:
                return
            layer, event = item
            try:
                event.synchronize()
                while True:  # the layers after it that are written too (events complete in order)
                    try:
                        after = self._events.get_nowait()
                    except queue.Empty:
                        break
                    if after is None or not after[1].query():
                        held.append(after)
                        break
                    layer = after[0]
                self.report(layer)
            except BaseException as e:  # surfaced by finish()
                self._error = e

    def finish(self) -> None:
        self._events.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


class IpcKVReceiver(KVReceiver):
    """Decode side: copies layer l from the mapped prefill pool into this pool's slots, on its own
    stream, when told the layer is done. Its copies are finished once `drain_marker()` completes;
    the prefill side's blocks stay held until the decode side says so (Release)."""

    def __init__(self, remote: RemotePool, pool: KVPool, block_table: list[int], num_tokens: int) -> None:
        self.remote, self.pool, self.num_tokens, self.block_table = remote, pool, num_tokens, block_table
        self.dst: torch.Tensor | None = None       # slot lists, when either side is not one run
        self.src: torch.Tensor | None = None
        self.src_first: int | None = None          # first slots, when each side is one run
        self.dst_first: int | None = None
        self.stream = torch.cuda.Stream(pool.device)
        self.done = torch.cuda.Event()
        self.copied = 0
        self.error: BaseException | None = None  # copies are queued by the caller; none fail on their own

    def start(self, src_block_table: list[int], src_block_size: int, src_start: int = 0) -> None:
        """The prompt's tokens from `src_start` on (those this side lacks) are read from the prefill
        pool's blocks. When both sides' blocks are one run of slots each layer is two plain copies
        (K, V) over NVLink; otherwise the two slot lists go to the devices for a gather and a scatter
        (uploaded on this receiver's stream: from pageable memory an upload first waits for its
        stream, and on the default stream that is the engine's step)."""
        n = self.num_tokens
        self.src_first = run_start(src_block_table, src_start + n, src_block_size, src_start)
        self.dst_first = self.pool.table_start(self.block_table, n)
        if self.src_first is not None and self.dst_first is not None:
            return
        with torch.cuda.stream(self.stream):
            self.src = slot_ids(src_block_table, src_start, src_start + n, src_block_size, self.remote.storage.device)
            self.dst = self.pool.slots(self.block_table, 0, n)

    def copy_layer(self, layer: int) -> None:
        src, dst, n = self.remote.storage[layer], self.pool.layers[layer], self.num_tokens
        with torch.cuda.stream(self.stream):
            if self.src_first is not None and self.dst_first is not None:
                for half in (0, 1):  # contiguous on both sides: a peer memcpy each
                    dst[half].narrow(0, self.dst_first, n).copy_(src[half].narrow(0, self.src_first, n))
            elif self.src is not None and self.dst is not None:
                # the gather runs where torch places the mapped memory; .to() then moves it over NVLink
                kv = as_bytes(src).index_select(1, self.src).to(self.pool.device, non_blocking=True)
                as_bytes(dst).index_copy_(1, self.dst, kv)
            else:
                raise IpcError("layer reported before the transfer started")
            self.copied += 1
            if self.copied == self.pool.layout.num_layers:
                self.done.record(self.stream)

    def complete(self) -> bool:
        return self.copied == self.pool.layout.num_layers and self.done.query()

    def drain_marker(self) -> torch.cuda.Event:
        """An event that completes once every copy issued so far has (then either side may free)."""
        marker = torch.cuda.Event()
        marker.record(self.stream)
        return marker
