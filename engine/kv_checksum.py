"""Per-layer checksums of a prompt's KV, computed where it lies (the GPU), to prove a handoff bit for bit.

Both servers run the same reduction over the same tokens in wire order, whatever their block sizes
and wherever the blocks sit: each layer's K and V rows (one per token) are read as 64-bit words and
summed, and the row sums are added up weighted by their place (K rows 1..n, V rows n+1..2n), all
wrapping around at 2**64. A changed word changes its row's sum; a row in the wrong place (a block
table off by one, K and V swapped, blocks freed and reused before they were read) moves its sum to
another weight. One reduction reads the whole prompt's KV once, in place: words as wide as the sum
need no widened copy (32-bit words summed in 64 bits made one, twice the KV's size, and took seven
times as long); the host waits once.

The decode side checks on a stream of its own (`verify_stream`): on the engine's stream the check
would wait for the decode step under way, and the next step for it.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVPool, as_bytes


def _row_words(kv: torch.Tensor) -> torch.Tensor:
    """`[..., tokens, heads, dim]` as `[..., tokens, words]` of int64 (a view where the rows are contiguous)."""
    rows = kv.flatten(-2)
    if rows.shape[-1] * rows.element_size() % 8:
        raise ValueError(f"a KV row of {rows.shape[-1]} x {rows.element_size()} bytes is not whole 64-bit words")
    return rows.view(torch.int64) if rows.stride(-1) == 1 else rows.contiguous().view(torch.int64)


def _weights(num_tokens: int, device: torch.device) -> torch.Tensor:
    """`[2, tokens]`: K row t weighs t + 1, V row t weighs tokens + t + 1."""
    return torch.arange(1, 2 * num_tokens + 1, dtype=torch.int64, device=device).view(2, num_tokens)


def layer_checksums_of(kv: torch.Tensor) -> torch.Tensor:
    """`[layers]` int64 on kv's device, from `[layers, 2, tokens, heads, dim]` KV in wire order."""
    row_sums = _row_words(kv).sum(-1)  # [layers, 2, tokens], int64 words summed as they are
    return (row_sums * _weights(kv.shape[2], kv.device)).sum((-2, -1))


def layer_checksums(pool: KVPool, block_table: list[int], num_tokens: int, start: int = 0) -> list[int]:
    """The checksum of each layer of tokens [start, num_tokens) at `block_table` (the KV a handoff
    sends), as unsigned 64-bit integers (the proto's uint64). Call once the KV is in the pool (after
    the writes' stream has them)."""
    first = pool.table_start(block_table, num_tokens, start)
    if first is not None:  # one run of slots: every layer read in place, in one reduction
        sums = layer_checksums_of(pool.storage.narrow(2, first, num_tokens - start))
    else:  # gathered a layer at a time: a copy of every layer at once could be gigabytes
        slots = pool.slots(block_table, start, num_tokens)
        sums = torch.cat([layer_checksums_of(as_bytes(layer).index_select(1, slots)[None]) for layer in pool.layers])
    return as_uint64(sums)


def as_uint64(sums: torch.Tensor) -> list[int]:
    """int64 checksums (wrapped sums) as the unsigned 64-bit integers the proto carries."""
    return [s % (1 << 64) for s in sums.tolist()]


class LayerChecksums:
    """The prefill side's checksums, taken layer by layer as the prefill finishes each layer's KV, on a
    stream of their own: they run under the later layers' compute, and only the last layer's is left
    when the prefill ends. Equal to `layer_checksums` over the same tokens once every layer is done."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, first: int | None = None) -> None:
        """`slots`: the sent tokens' slots in wire order (as the KV sender has them); `first`: where they start
        in the pool when they are one run, read in place."""
        self.pool, self.slots, self.first = pool, slots, first
        self.stream = verify_stream(pool.device)
        self.sums: list[torch.Tensor] = []

    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s KV is written (queued on the current stream): take its checksum after it."""
        if self.stream is None:
            self.sums.append(self._one(layer))
            return
        written = torch.cuda.Event()
        written.record()
        self.stream.wait_event(written)
        with torch.cuda.stream(self.stream):
            self.sums.append(self._one(layer))

    def _one(self, layer: int) -> torch.Tensor:
        return layer_checksums_of(self.pool.read(layer, self.slots, self.first)[None])

    def result(self) -> list[int]:
        """Every layer's checksum (the host waits for the last)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        if len(self.sums) != self.pool.layout.num_layers:
            raise RuntimeError(f"checksums of {len(self.sums)} layers of {self.pool.layout.num_layers}")
        return as_uint64(torch.cat(self.sums))


_VERIFY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def verify_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream the decode side checks a handoff on (one a device, high priority); None off CUDA."""
    if device.type != "cuda":
        return None
    if device not in _VERIFY_STREAMS:
        _VERIFY_STREAMS[device] = torch.cuda.Stream(device, priority=-1)
    return _VERIFY_STREAMS[device]


def layer_checksums_on_own_stream(pool: KVPool, block_table: list[int], num_tokens: int,
                                  start: int = 0) -> list[int]:
    """`layer_checksums` on `verify_stream`: for KV whose arrival the host has already seen complete
    (the check needs nothing queued on the engine's stream, and must not wait behind it)."""
    stream = verify_stream(pool.device)
    if stream is None:
        return layer_checksums(pool, block_table, num_tokens, start)
    with torch.cuda.stream(stream):
        return layer_checksums(pool, block_table, num_tokens, start)


def first_mismatch(ours: list[int], theirs: list[int]) -> int | None:
    """The first layer whose checksums differ (or the count, when the lists' lengths do); None if all agree."""
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return layer
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))
