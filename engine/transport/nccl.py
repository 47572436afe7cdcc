"""KV over NCCL between the pair's GPUs, layer by layer.

Each prefill/decode pair gets its own two-rank `ProcessGroupNCCL`, made when the pair first
meets (no global `init_process_group`, so any number of servers can pair, across pods and
nodes). Its rendezvous store lives inside the prefill server, and the decode side reaches it
over the authenticated gRPC channel (engine.transport.nccl_rendezvous): no store port is opened.

On CPU pools (tests) the same protocol runs over Gloo, with each receive waited on by the host.

Sends and receives of one pair must be posted in the same order on both sides: the prefill side
numbers its transfers (`TransferStart.sequence`) and the decode side posts its receives in that
order. A send waits on the prefill stream's pending work, so layer l leaves as soon as its
prefill kernels finish while later layers compute. Nothing is ever blocked on forever: every wait
polls with a deadline, and a pair that fails is aborted and made anew at the next handshake.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.kv_cache import KVPool
from engine.transport.base import KVReceiver, KVSender, TransferCancelled

log = logging.getLogger(__name__)

PREFILL_RANK, DECODE_RANK = 0, 1
# How often a waiting thread looks at its works. A sleep of 200 us lasts about 250 (the kernel's
# timer slack); a transfer's last message is watched 10 times as often on both sides, as its landing
# ends the handoff (each look takes the GIL for a few microseconds).
POLL_S, LAST_POLL_S = 0.0002, 0.00002


class TransferFailed(Exception):
    """The peer stopped answering mid-transfer; the pair is aborted."""


def poll_s_for(index: int, count: int) -> float:
    """How often to look at message `index` of a transfer's `count`."""
    return LAST_POLL_S if index == count - 1 else POLL_S


def wait_until(done: Callable[[], bool], deadline: float, what: str, poll_s: float = POLL_S) -> None:
    while not done():
        if time.monotonic() > deadline:
            raise TransferFailed(f"{what} did not finish in time")
        time.sleep(poll_s)


def completed(works: list[Any]) -> bool:
    """Every work of a message (`NcclPair.post`) has completed (NCCL: polled without blocking)."""
    return all(w.is_completed() for w in works)


def wait_work(works: list[Any], device: torch.device, deadline: float, what: str,
              aborted: Callable[[], bool] | None = None, poll_s: float = POLL_S) -> None:
    """Until every work of a message (`NcclPair.post`) completes. NCCL works complete on their
    own (polled, so nothing blocks past the deadline, nor past `aborted()` turning true); Gloo's
    p2p works only progress inside wait()."""
    if device.type == "cuda":
        stop = aborted or (lambda: False)
        wait_until(lambda: completed(works) or stop(), deadline, what, poll_s)
        if stop():
            raise TransferFailed(f"{what} stopped: the pair was aborted")
        return
    for work in works:
        try:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as e:
            raise TransferFailed(f"{what} did not finish in time ({e})") from e


def _process_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> Any:
    """A two-rank Backend (send/recv take lists of tensors; the typing stubs don't say so)."""
    timeout = timedelta(seconds=max(60.0, timeout_s * 4))
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


class NcclPair:
    """One side of a pair's process group."""

    def __init__(self, store: dist.Store, group: str, rank: int, device: torch.device, timeout_s: float) -> None:
        self.group, self.rank, self.device, self.timeout_s = group, rank, device, timeout_s
        self.store = store  # torch reaches a store written in Python through this object: keep it alive
        self.pg = _process_group(dist.PrefixStore(group, store), rank, device, timeout_s)
        self.peer = 1 - rank
        self.lock = threading.Lock()     # posts of one pair never interleave
        # the decode side's staging buffers and scatters: one stream, so its cached blocks are reused
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.next_sequence = 0
        self.broken = False
        self.retired: list[object] = []  # buffers and works of failed transfers that NCCL may still write

    def warm_up(self) -> None:
        """The first p2p call creates the communicator (both ranks must take part)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # the communicator that grouped sends use, made outside any group: one made inside a group
            # that then fails leaves torch's group count off, and every later pairing of this process fails
            self.pg.eager_connect_single_device(self.device)
        t = torch.zeros(2, device=self.device)
        works = self.post([t[:1], t[1:]], send=self.rank == PREFILL_RANK)
        wait_work(works, self.device, time.monotonic() + 120, f"NCCL pairing {self.group}")

    def post(self, tensors: list[torch.Tensor], send: bool) -> list[Any]:
        """Send (or receive) one message: a layer's K and V, each a contiguous tensor. On GPUs the
        two go as one coalesced NCCL launch (a grouped send/recv, as `batch_isend_irecv` does; the
        pair's one communicator); Gloo takes them one by one."""
        op = self.pg.send if send else self.pg.recv
        tensors = [t.view(torch.uint8) if t.element_size() == 1 else t for t in tensors]  # e4m3 KV as its bytes
        if self.device.type != "cuda":
            return [op([t], self.peer, 0) for t in tensors]
        self.pg._start_coalescing()
        try:
            for t in tensors:
                op([t], self.peer, 0)
        finally:  # a group left open would poison every later group on this process
            work = self.pg._end_coalescing()
        return [work]

    def abort(self) -> None:
        self.broken = True
        try:
            self.pg.abort()
        except Exception:  # already gone
            log.debug("abort of NCCL pair %s failed", self.group, exc_info=True)


class NcclKVSender(KVSender):
    """Prefill side: one message per layer of the prompt's KV, its K and V. `first`
    (`KVPool.table_start`) says the slots are one run: then K and V go straight from the pool's
    slices, copied by nobody; otherwise a layer is gathered out of the pool first."""

    cancellable = False

    def __init__(self, pair: NcclPair, pool: KVPool, slots: torch.Tensor, deadline_s: float,
                 first: int | None = None) -> None:
        self.pair, self.pool, self.slots, self.first = pair, pool, slots, first
        self.deadline_s = deadline_s
        self._inflight: list[tuple[torch.Tensor, list[Any]]] = []
        self.posted_at: list[float] = []  # perf_counter when each layer's send was posted (benchmarks)
        self.sequence = pair.next_sequence
        pair.next_sequence += 1

    def layer_done(self, layer: int) -> None:
        if self.pair.broken:
            raise TransferCancelled
        kv = self.pool.read(layer, self.slots, self.first)  # [2, n, heads, dim]: its halves are contiguous
        self._inflight.append((kv, self.pair.post([kv[0], kv[1]], send=True)))
        self.posted_at.append(time.perf_counter())

    def finish(self) -> None:
        """Every layer is sent (the decode side's receives are posted before the sends can finish).
        A cancelled request still completes its sends: the peer has posted the receives."""
        deadline = time.monotonic() + self.deadline_s
        try:
            for i, (_, works) in enumerate(self._inflight):
                wait_work(works, self.pair.device, deadline, "NCCL send of the KV",
                          poll_s=poll_s_for(i, len(self._inflight)))
        except TransferFailed:
            self.pair.abort()
            raise
        finally:
            self._inflight.clear()


class NcclKVReceiver(KVReceiver):
    """Decode side: posts every layer's receive at once, then a thread watches them land. When the
    prompt's blocks are one run, NCCL writes each layer's K and V straight into the pool's slices;
    otherwise into one staging buffer, which the thread scatters into the pool's slots (on the
    pair's stream, every layer that has landed in one copy). The engine's stream never waits on the
    network, and the set-up makes one call into torch, not one a layer, as each such call from a
    side thread waits its turn (bench/NOTES.md). A failed transfer's staging buffer is kept by the
    pair, as NCCL may still write into it; a failed transfer into the pool leaves the blocks to the
    handoff, which frees them once the aborted pair's kernels are gone (`into_pool`)."""

    def __init__(self, pair: NcclPair, pool: KVPool, block_table: list[int], num_tokens: int) -> None:
        self.pair, self.pool, self.num_tokens = pair, pool, num_tokens
        started = time.monotonic()
        self.stream = pair.stream
        self.first = pool.table_start(block_table, num_tokens)
        self.slots: torch.Tensor | None = None
        if self.first is None:  # uploaded on the pair's stream: from pageable memory an upload first waits for it
            with self._stream():
                self.slots = pool.slots(block_table, 0, num_tokens)
        self.set_up_s: dict[str, float] = {"slots": time.monotonic() - started}  # where the set-up's time goes
        self.done = torch.cuda.Event() if pool.device.type == "cuda" else None
        self.posted = False                 # receives are posted: the peer may write into their buffers
        self.stopped = threading.Event()    # the watching thread is done, whole or not
        self.error: BaseException | None = None
        self.landed_at: list[float] = []  # perf_counter when each layer was seen landed (benchmarks)
        self._whole = False  # every layer is in the pool (landed there, or scattered and queued)

    @property
    def into_pool(self) -> bool:
        """NCCL writes the pool's blocks themselves (they are one run), not a staging buffer."""
        return self.first is not None

    def _stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def post(self, sequence: int, deadline: float) -> None:
        """Once the pair reaches `sequence`, post every layer's receive and start the watching thread."""
        pair = self.pair
        mark = time.monotonic()

        def lap(part: str) -> None:
            nonlocal mark
            now = time.monotonic()
            self.set_up_s[part] = now - mark
            mark = now

        wait_until(lambda: pair.next_sequence >= sequence or pair.broken, deadline, "earlier NCCL transfers")
        lap("earlier_transfers")
        lay = self.pool.layout
        with pair.lock:
            lap("lock")
            if pair.broken or pair.next_sequence != sequence:
                raise TransferFailed(f"NCCL pair {pair.group} is out of step (at {pair.next_sequence}, "
                                     f"transfer {sequence})")
            if self.stream is not None:
                torch.cuda.set_device(self.pool.device)
            with self._stream():
                staging = None
                if self.first is not None:
                    targets = [self.pool.run(layer, self.first, self.num_tokens) for layer in range(lay.num_layers)]
                else:
                    staging = torch.empty(lay.num_layers, 2, self.num_tokens, lay.num_kv_heads, lay.head_dim,
                                          dtype=lay.torch_dtype, device=self.pool.device)
                    targets = list(staging)
                lap("buffers")
                works = [pair.post([kv[0], kv[1]], send=False) for kv in targets]
                lap("receives")
            self.posted = True
            pair.next_sequence += 1
        threading.Thread(target=self._watch, args=(staging, works, deadline), daemon=True,
                         name="nccl-receive").start()
        lap("thread")
        log.debug("NCCL receive set-up of %d tokens (ms): %s", self.num_tokens,
                  {k: round(v * 1e3, 2) for k, v in self.set_up_s.items()})

    def _watch(self, staging: torch.Tensor | None, works: list[list[Any]], deadline: float) -> None:
        pair = self.pair
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.pool.device)
            layer = 0
            while layer < len(works):
                wait_work(works[layer], self.pool.device, deadline, f"NCCL receive of layer {layer} ({pair.group})",
                          aborted=lambda: pair.broken, poll_s=poll_s_for(layer, len(works)))
                end = layer + 1  # and the layers after it that have landed too: one scatter for them all,
                while end < len(works) and completed(works[end]):  # as each call waits for the GIL
                    end += 1
                self.landed_at += [time.perf_counter()] * (end - layer)
                if staging is not None:
                    assert self.slots is not None
                    with self._stream():
                        self.pool.write_layers(layer, end, self.slots, staging[layer:end])
                layer = end
            if self.done is not None:
                self.done.record(self.stream)
            self._whole = True
        except BaseException as e:  # surfaced by the handoff (complete() stays False)
            self.error = e
            pair.retired.append((staging, works))
        finally:
            self.stopped.set()

    def complete(self) -> bool:
        return self._whole and (self.done is None or self.done.query())

    def drain_marker(self) -> Any:
        """Completes once every scatter queued so far has (call after `stopped`)."""
        if self.stream is None:
            return None
        marker = torch.cuda.Event()
        marker.record(self.stream)
        return marker
