"""The decode server's engine thread: continuous batching over the KV pool.

Each iteration of `step()` reads as schedule, run, postprocess:
- schedule: take new work from the inbox, drop cancelled sequences (freeing their KV), admit
  ready sequences into the running batch up to --max-batch-size;
- run: at most one local prefill piece (a whole prompt when colocated, one chunk when chunked, a
  slice of the model's layers over the whole prompt when layered), then one decode step for every
  running sequence;
- postprocess: sampled tokens go to each request's stream; finished sequences leave and free KV.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import torch

from decode_server import metrics
from decode_server.sequence import ErrorEvent, Sequence
from engine.host_read import TokenReader
from engine.runner import DecodeSeq, ModelRunner
from engine.sampling import sample

log = logging.getLogger(__name__)


@dataclass
class LayeredPrefill:
    """The head prompt's prefill under way in layered mode: one slice of layers an engine step."""

    seq: Sequence
    slices: Iterator[torch.Tensor | None]  # ModelRunner.prefill_slices
    started: float


class DecodeEngine:
    def __init__(self, runner: ModelRunner, max_batch_size: int, layer_slice_tokens: int = 32768,
                 die_after_steps: int | None = None) -> None:
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.layer_slice_tokens = layer_slice_tokens  # layered mode: prompt tokens x layers a slice
        self.die_after_steps = die_after_steps  # fault injection (PD_FAULT_ENGINE_DIE_AFTER_STEPS)
        self._submit_lock = threading.Lock()       # orders submit() against the loop's death
        self._inbox: queue.Queue[Sequence] = queue.Queue()
        self.prefilling: deque[Sequence] = deque()  # local prefill, FIFO
        self.ready: deque[Sequence] = deque()       # first token out, waiting for a batch slot
        self.running: list[Sequence] = []
        self.layered: LayeredPrefill | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="decode-engine")
        self.failed: BaseException | None = None
        self.on_failure: list[Callable[[], object]] = []  # run on this thread if the loop dies
        self.on_blocks_freed: Callable[[], object] = lambda: None  # thread-safe notifier
        self.steps = 0
        self._tokens = TokenReader(runner.device, max(1, max_batch_size))  # used on the engine thread only

    # --- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once it is ready to run requests."""
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put_nowait(None)  # type: ignore[arg-type]
        self._thread.join(timeout=10)

    def submit(self, seq: Sequence) -> None:
        """Hand a sequence over: it needs a local prefill (no output yet) or is ready to decode.

        From here on only the engine thread frees its blocks; if the engine has died, the sequence
        gets its error at once (and its blocks back) instead of waiting for a loop that is gone."""
        with self._submit_lock:
            seq.in_engine = True
            if self.failed is None:
                self._inbox.put_nowait(seq)
                return
        self._fail(seq, self.failed)

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + len(self.prefilling) + len(self.ready)

    # --- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            try:
                self.runner.prepare_engine_thread()
            finally:
                self._ready.set()
            while not self._stop.is_set():
                self.step()
        except BaseException as e:  # the engine is gone: health must say so and the process exit
            log.exception("decode engine loop died")
            with self._submit_lock:
                self.failed = e
            stranded = [*self.prefilling, *self.ready, *self.running]
            self.prefilling.clear()
            self.ready.clear()
            self.running.clear()
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    stranded.append(item)
            for seq in stranded:
                self._fail(seq, e)
            for callback in self.on_failure:
                callback()

    def _fail(self, seq: Sequence, error: BaseException) -> None:
        seq.emit(ErrorEvent(grpc.StatusCode.UNAVAILABLE,
                            f"the decode engine failed ({type(error).__name__}: {error}); this server is exiting, "
                            "retry on another replica"))
        self._finish(seq)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    (self.ready if item.output else self.prefilling).append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for group in (self.prefilling, self.ready):
            for seq in [s for s in group if s.cancelled.is_set()]:
                group.remove(seq)
                if self.layered is not None and self.layered.seq is seq:
                    self.layered = None  # its slices so far are queued before any later use of its blocks
                self._finish(seq)
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self.running.remove(seq)
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.release(self.runner.pool.allocator):
            self.on_blocks_freed()

    def step(self) -> None:
        # schedule
        idle = not (self.prefilling or self.ready or self.running)
        self._take_inbox(block=idle)
        self._drop_cancelled()
        while self.ready and len(self.running) < self.max_batch_size:
            self.running.append(self.ready.popleft())
        # run + postprocess
        if self.prefilling:
            head = self.prefilling[0]
            if head.mode == "layered":
                self._prefill_slice(head)
            else:
                self._prefill_piece(head)
        if self.running:
            self._decode_step()
        if self.die_after_steps is not None and self.steps >= self.die_after_steps:
            raise RuntimeError(f"fault injection: PD_FAULT_ENGINE_DIE_AFTER_STEPS={self.die_after_steps} reached")

    def _prefill_piece(self, seq: Sequence) -> None:
        """The whole prompt (colocated) or its next chunk (chunked); samples the first token at the end."""
        size = seq.chunk_size if seq.mode == "chunked" else len(seq.prompt)
        start = seq.prefilled
        piece = seq.prompt[start:start + size]
        t0 = time.perf_counter()
        try:
            logits = self.runner.prefill(piece, seq.block_table, start)
        except Exception as e:
            self._prefill_failed(seq, e)
            return
        seq.prefilled += len(piece)
        if seq.prefilled < len(seq.prompt):
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)  # a chunk is one scheduled unit of work
            seq.timing.prefill_s += time.perf_counter() - t0
            return
        self._first_token(seq, logits, t0)

    def _prefill_slice(self, seq: Sequence) -> None:
        """The next slice of the model's layers over the whole prompt (layered); queued, not waited
        for: the decode step after it waits for both. The last slice samples the first token."""
        if self.layered is None or self.layered.seq is not seq:
            slices = self.runner.prefill_slices(seq.prompt, seq.block_table, self.layer_slice_tokens)
            self.layered = LayeredPrefill(seq, slices, time.perf_counter())
        started = self.layered.started
        try:
            logits = next(self.layered.slices)
        except Exception as e:
            self.layered = None
            self._prefill_failed(seq, e)
            return
        if logits is None:
            return
        self.layered = None
        seq.prefilled = len(seq.prompt)
        self._first_token(seq, logits, started)

    def _prefill_failed(self, seq: Sequence, error: Exception) -> None:
        """One prompt's prefill failed: that request fails, the batch goes on."""
        self.prefilling.popleft()
        if isinstance(error, torch.cuda.OutOfMemoryError):
            seq.emit(ErrorEvent(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory in prefill: {error}"))
        else:
            log.error("local prefill of %s failed", seq.request_id, exc_info=error)
            seq.emit(ErrorEvent(grpc.StatusCode.INTERNAL, f"prefill failed: {type(error).__name__}: {error}"))
        self._finish(seq)

    def _first_token(self, seq: Sequence, logits: torch.Tensor, started: float) -> None:
        """The prompt's prefill (or its last piece, begun at perf_counter `started`) is queued and seq
        is the head of `prefilling`: sample and send its first token once the device has it."""
        token = self._tokens.read(sample(logits[None], [seq.params], [0]))[0]
        elapsed = time.perf_counter() - started
        seq.timing.prefill_s += elapsed
        metrics.PREFILL_SECONDS.observe(seq.timing.prefill_s)
        self.prefilling.popleft()
        seq.append(token, elapsed)
        if seq.finish_reason:
            self._finish(seq)
        else:
            self.ready.append(seq)

    def _decode_step(self) -> None:
        seqs = self.running
        t0 = time.perf_counter()
        batch = [DecodeSeq(s.output[-1], len(s.prompt) + len(s.output) - 1, s.block_table) for s in seqs]
        logits, greedy = self.runner.decode(batch)
        tokens = self._tokens.read(sample(logits, [s.params for s in seqs], [len(s.output) for s in seqs], greedy))
        elapsed = time.perf_counter() - t0
        self.steps += 1
        metrics.DECODE_STEP.observe(elapsed)
        finished = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token, elapsed)
            if seq.finish_reason:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self._finish(seq)
