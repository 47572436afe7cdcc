"""The prefill server's engine thread: runs prefill jobs one at a time, ships KV layer by layer."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import torch
from pd.v1 import prefill_pb2

from engine.host_read import TokenReader
from engine.kv_cache import KVPool
from engine.kv_checksum import LayerChecksums
from engine.prefix_cache import PrefixCache
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample
from engine.transport.base import KVSender, TransferCancelled
from engine.warmup import WarmUp
from prefill_server import metrics
from prefill_server.kv_lease import KVLeases
from serving.kv_release import KV_LEASE_S
from serving.token_ids import TokenIds, as_array

log = logging.getLogger(__name__)
request_log = logging.getLogger("prefill_server.requests")  # one JSON line per finished prefill

# A message of a job's response stream: a PrefillResponse, or a KV chunk pre-encoded as one (grpc_wire).
Message: TypeAlias = prefill_pb2.PrefillResponse | bytes


class JobOutput(Protocol):
    """Where a job's messages go, in order, from the engine thread (and its senders' threads) to the
    job's Prefill call; `end` comes once, last: the error that failed the job, or None."""

    def send(self, message: Message) -> None: ...

    def end(self, error: Exception | None = None) -> None: ...


SenderFactory = Callable[["PrefillJob", torch.Tensor], KVSender]  # (job, its slots) -> its KV's sender


@dataclass
class PrefillJob:
    request_id: str
    token_ids: TokenIds
    params: SamplingParams
    block_table: list[int]
    transport: str
    chunk_tokens: int
    out: JobOutput
    make_sender: SenderFactory  # the agreed transport's (prefill_server.transports)
    peer_id: str = ""  # the decode server whose Release lets go of the blocks
    kv_checksums: bool = False
    cached_tokens: int = 0  # leading tokens whose KV the prefix cache gave: the prefill starts after them
    send_from: int = 0      # leading tokens whose KV the decode side holds: not sent
    cache_salt: str = ""    # the prompt's prefix-cache namespace
    dst_block_table: list[int] = field(default_factory=list)  # nixl: the decode side's blocks, and their size
    dst_block_size: int = 0
    dst_tag: str = ""  # nixl: the transfer's name in its notifications
    # called when the job is cancelled before its sender exists: a transport whose peer waits for a
    # last word (nixl's "end" notification) gives it there
    never_sent: Callable[[PrefillJob], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def uncached_tokens(self) -> int:
        return len(self.token_ids) - self.cached_tokens

    def send_start(self, pool: KVPool) -> int | None:
        """Where the KV it sends (tokens send_from on) starts in the pool, if one run of slots."""
        return pool.table_start(self.block_table, len(self.token_ids), self.send_from)


class PrefillWorker:
    """Runs jobs; a finished job's blocks (whatever its outcome) go to `leases`, held for its decode side."""

    def __init__(self, runner: ModelRunner, cache: PrefixCache, warm_up: bool = False,
                 lease_s: float = KV_LEASE_S) -> None:
        self.runner, self.cache = runner, cache
        self.warm_up = warm_up  # prefill every kind of prompt once before `start` returns (engine.warmup)
        self.leases = KVLeases(cache.release, lease_s)
        self._tokens = TokenReader(runner.device, 1)  # used on the worker thread only
        self._jobs: queue.Queue[PrefillJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="prefill-engine")
        self.failed = threading.Event()
        self._ready = threading.Event()
        self.busy = 0
        self._backlog_lock = threading.Lock()
        self.backlog_tokens = 0  # uncached prompt tokens submitted and not yet finished (waiting or running)

    def start(self) -> None:
        """Start the engine thread; returns once it is ready to run jobs."""
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self.leases.close()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: PrefillJob) -> None:
        with self._backlog_lock:
            self.backlog_tokens += job.uncached_tokens
        self._jobs.put(job)
        metrics.REQUESTS_WAITING.set(self._jobs.qsize())

    def _loop(self) -> None:
        try:
            self.runner.prepare_engine_thread()
            if self.warm_up:
                warm = WarmUp(self.runner)
                warm.run("whole prompts", warm.whole_prompts)
                warm.run("sampling", lambda: warm.sampling(self._tokens))
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            metrics.REQUESTS_WAITING.set(self._jobs.qsize())
            self.busy = 1
            metrics.REQUESTS_RUNNING.set(1)
            try:
                self._run(job)
            except TransferCancelled:
                log.info("prefill %s cancelled", job.request_id)
                job.out.end()
            except Exception as e:  # the request fails, the worker keeps serving
                log.exception("prefill %s failed", job.request_id)
                job.out.end(e)
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
            finally:
                self._finished(job)
                self.leases.hold(job.peer_id, job.request_id, job.block_table)
                self.busy = 0
                metrics.REQUESTS_RUNNING.set(0)

    def _finished(self, job: PrefillJob) -> None:
        """The job no longer counts towards the backlog (called once a job has run, whatever its outcome)."""
        with self._backlog_lock:
            self.backlog_tokens -= job.uncached_tokens

    def _run(self, job: PrefillJob) -> None:
        dequeued = time.perf_counter()
        if job.cancelled.is_set():
            if job.never_sent is not None:
                job.never_sent(job)
            raise TransferCancelled
        slots = self.runner.pool.slots(job.block_table, job.send_from, len(job.token_ids))
        sender = job.make_sender(job, slots)
        try:
            self._prefill(job, sender, slots, dequeued)
        finally:
            sender.release()  # after the answer has left: off its path

    def _prefill(self, job: PrefillJob, sender: KVSender, slots: torch.Tensor, dequeued: float) -> None:
        """The job's prefill, its KV handed to `sender` layer by layer, then its answer sent."""
        runner = self.runner
        n, cached, skip = len(job.token_ids), job.cached_tokens, job.send_from
        checks = LayerChecksums(runner.pool, slots, job.send_start(runner.pool)) if job.kv_checksums else None

        def layer_done(layer: int) -> None:
            if job.cancelled.is_set() and sender.cancellable:
                raise TransferCancelled
            sender.layer_done(layer)
            if checks is not None:  # under the next layers' compute, after the send is queued
                checks.layer_done(layer)

        started = time.perf_counter()
        try:
            uncached = as_array(job.token_ids)[cached:] if cached else job.token_ids
            logits = runner.prefill(uncached, job.block_table, cached, on_layer_done=layer_done)
            first = self._tokens.read(sample(logits[None], [job.params], [0]))[0]  # waits for the prefill
            self.cache.publish(job.token_ids, job.block_table, n, job.cache_salt)
        finally:
            computed = time.perf_counter()
            sender.finish()
        sent = time.perf_counter()
        if job.cancelled.is_set():
            raise TransferCancelled
        kv_bytes = (n - skip) * runner.layout.bytes_per_token
        checksums = checks.result() if checks is not None else []
        checked = time.perf_counter()
        metrics.PREFILL_SECONDS.observe(computed - started)
        metrics.KV_TRANSFER_SECONDS.observe(sent - computed)
        metrics.KV_TRANSFER_BYTES.labels(job.transport).inc(kv_bytes)
        done = prefill_pb2.PrefillDone(first_token_id=first, prefill_s=computed - started, kv_send_s=sent - computed,
                                       kv_bytes=kv_bytes, layer_checksums=checksums, queue_s=dequeued - job.submitted,
                                       checksum_s=checked - sent, cached_tokens=cached,
                                       backlog_tokens=max(0, self.backlog_tokens - job.uncached_tokens))
        job.out.send(prefill_pb2.PrefillResponse(done=done))
        job.out.end()
        request_log.info(json.dumps({
            "event": "prefill_finished", "request_id": job.request_id, "prompt_tokens": n,
            "cached_tokens": cached, "sent_tokens": n - skip, "transport": job.transport,
            "queue_s": round(done.queue_s, 6), "setup_s": round(started - dequeued, 6),
            "prefill_s": round(done.prefill_s, 6), "kv_send_s": round(done.kv_send_s, 6),
            "checksum_s": round(done.checksum_s, 6)}))
