"""The decode server's batch loop: continuous batching over the KV pool, on its own thread.

Each iteration of `step()` reads as schedule, run, postprocess:
- schedule: take arrivals from the inbox (a prompt to prefill here, a prompt prefilled elsewhere
  with its first token, a cancelled request to let go), drop cancelled sequences, admit ready
  sequences into the running batch up to --max-batch-size;
- run: at most one local prefill piece (decode_server.local_prefill: a whole prompt when colocated,
  one chunk when chunked, a slice of the model's layers over the whole prompt when layered), then
  one decode step for every running sequence (decode_server.decode_steps); a partitioned prompt is
  prefilled meanwhile on the partitioned-prefill thread (decode_server.partitioned), whose
  `PrefillDone` comes back through the inbox;
- postprocess: each sampled token goes into its request's `RequestOutput`, and the readers on
  the event loop are woken once for the step; finished sequences leave and give their KV blocks
  back (`Admission.release`, called on this thread only).

From `submit` on, the sequence and its blocks belong to this loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from decode_server.admission import Admission
from decode_server.decode_steps import DecodeSteps
from decode_server.local_prefill import LocalPrefill
from decode_server.partitioned import PrefillDone
from decode_server.sequence import Rejected, RequestOutput, RequestSequence
from decode_server.step_trace import StepTrace
from engine.green_context import SmPartitions
from engine.logprobs import TokenLogprobs
from engine.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class _Arrival:
    seq: RequestSequence
    first_token: int | None  # sampled by a prefill server; None: prefill here


class BatchScheduler:
    def __init__(self, runner: ModelRunner, admission: Admission, max_batch_size: int,
                 layer_slice_tokens: int = 32768, die_after_steps: int | None = None,
                 partitions: SmPartitions | None = None, prefill_sms: int = 0, warm_up: bool = False,
                 overlap_steps: bool = True, trace: StepTrace | None = None,
                 partitioned_short_first: bool = False) -> None:
        """`partitions` and `prefill_sms`: where partitioned prompts are prefilled, beside the decode
        steps; without them a partitioned prompt is prefilled as a layered one (`partitioned_short_first`:
        `decode_server.partitioned`'s order of short prompts among long ones). `warm_up`: run every
        local prefill path once before `start` returns (engine.warmup). `overlap_steps`: queue each
        decode step before the last one's tokens are read back (decode_server.decode_steps)."""
        self.runner = runner
        self.warm_up = warm_up
        self.admission = admission
        self.loop = admission.loop  # where the outputs' readers run
        self.max_batch_size = max_batch_size
        self.die_after_steps = die_after_steps  # fault injection (PD_FAULT_ENGINE_DIE_AFTER_STEPS)
        self._submit_lock = threading.Lock()       # orders submit() against the loop's death
        self._inbox: queue.Queue[_Arrival | PrefillDone | None] = queue.Queue()
        self.local = LocalPrefill(runner, admission, self, max_batch_size, layer_slice_tokens, partitions,
                                  prefill_sms, self._inbox.put_nowait, trace, partitioned_short_first)
        self.ready: deque[RequestSequence] = deque()  # first token out, waiting for a batch slot
        self.running: list[RequestSequence] = []
        self.decode = DecodeSteps(runner, admission, self, max_batch_size, overlap_steps, trace)
        self._woken: list[RequestOutput] = []       # outputs added since the last wake-up
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="decode-engine")
        self.failed: BaseException | None = None
        self.on_failure: list[Callable[[], object]] = []  # run on this thread if the loop dies
        # remote prefills under way whose first token may be submitted: counted here only
        # (submit_after_remote_prefill, _arrive)
        self._remote_first_tokens = 0
        self._remote_first_tokens_lock = threading.Lock()

    # --- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once it is ready to run requests."""
        if self.local.partitioned is not None:
            self.local.partitioned.start()
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put_nowait(None)
        self._thread.join(timeout=10)
        if self.local.partitioned is not None:
            self.local.partitioned.stop()

    def submit(self, seq: RequestSequence, first_token: int | None = None) -> None:
        """Hand an admitted sequence over: to prefill here, or (`first_token` given, through
        `submit_after_remote_prefill`) prefilled by a prefill server, its KV in the pool; its first
        token is appended on the engine thread like any other. A cancelled sequence is only let go
        (its blocks freed).

        If the engine has died, the sequence gets its error at once (and its blocks go back)
        instead of waiting for a loop that is gone."""
        with self._submit_lock:
            if self.failed is None:
                self._inbox.put_nowait(_Arrival(seq, first_token))
                return
        self._fail(seq, self.failed)

    async def submit_after_remote_prefill(self, seq: RequestSequence, prefill: Awaitable[int]) -> None:
        """Await `prefill` (a prefill server's first token, its KV landing in seq's blocks) and submit
        seq with that token. Until the token is taken on the engine thread, or the prefill fails,
        decode steps look for it while they run, so it leaves at once, not after the step."""
        with self._remote_first_tokens_lock:
            self._remote_first_tokens += 1
        try:
            first_token = await prefill
        except BaseException:
            with self._remote_first_tokens_lock:
                self._remote_first_tokens -= 1
            raise
        self.submit(seq, first_token)

    def let_go(self, seq: RequestSequence) -> None:
        """An admitted sequence that ends before it was submitted (its remote prefill failed, or it
        was cancelled): the loop frees its blocks."""
        seq.cancelled.set()
        self.submit(seq)

    def check_prefill_sms(self, num_sms: int) -> str | None:
        """Why a request can't have its partitioned prefill on `num_sms` SMs; None if it can."""
        return self.local.check_prefill_sms(num_sms)

    @property
    def step_in_flight(self) -> bool:
        """An overlapped decode step is queued whose tokens (and held blocks) the loop has yet to take."""
        return self.decode.in_flight is not None

    @property
    def steps(self) -> int:
        return self.decode.steps

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + self.local.waiting + len(self.ready)

    # --- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            try:
                self.runner.prepare_engine_thread()
                if self.warm_up:
                    self.local.warm_up()
            finally:
                self._ready.set()
            while not self._stop.is_set():
                self.step()
        except BaseException as e:  # the engine is gone: health must say so and the process exit
            log.exception("decode engine loop died")
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Every sequence this loop holds, and every later submit, gets `error`; then `on_failure` runs."""
        self._wake_readers()  # tokens already out, a last one among them
        with self._submit_lock:
            self.failed = error
        self.decode.abandon()
        stranded = [*self.local.prefilling, *self.ready, *self.running]
        self.local.prefilling.clear()
        self.ready.clear()
        self.running.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                stranded.append(item.seq)
        for seq in stranded:
            self._fail(seq, error)
        for seq in self.local.in_partition:  # its prefill may still write its blocks: they stay out of circulation
            self._fail(seq, error, release=False)
        for callback in self.on_failure:
            callback()

    def _fail(self, seq: RequestSequence, error: BaseException, release: bool = True) -> None:
        """Any thread, once the loop is gone: the blocks go back, then the request hears of it."""
        if release:
            self.admission.release(seq)
        seq.out.add(Rejected(grpc.StatusCode.UNAVAILABLE,
                             f"the decode engine failed ({type(error).__name__}: {error}); this server is exiting, "
                             "retry on another replica"))
        self.loop.call_soon_threadsafe(RequestOutput.wake_all, [seq.out])

    def _wake_readers(self) -> None:
        """One hop to the event loop for every output added since the last one."""
        if self._woken:
            woken, self._woken = self._woken, []
            self.loop.call_soon_threadsafe(RequestOutput.wake_all, woken)

    def take_arrivals(self, wait_s: float = 0.0) -> None:
        """Take every arrival, waiting up to `wait_s` for the first; wake the readers of what came out."""
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
            while True:
                if isinstance(item, PrefillDone):
                    self.local.partition_done(item)
                elif item is not None:
                    self._arrive(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        self._wake_readers()

    def remote_first_token_due(self) -> bool:
        return self._remote_first_tokens > 0

    def _arrive(self, arrival: _Arrival) -> None:
        seq = arrival.seq
        if arrival.first_token is not None:
            with self._remote_first_tokens_lock:
                self._remote_first_tokens -= 1
        if seq.cancelled.is_set():
            self.admission.release(seq)
        elif arrival.first_token is None:
            self.local.add(seq)
        else:
            now = time.perf_counter()  # its KV is in the pool: the handoff completed before submit
            self.prompt_done(seq, arrival.first_token, now - seq.timing.admitted, now)

    def append(self, seq: RequestSequence, token: int, step_s: float, now: float,
               logprobs: TokenLogprobs | None = None) -> bool:
        """Record a token and send it; True (and the sequence's blocks given back) if it was the last.
        A finished sequence's blocks stay cached with its answer in them: a chat's next turn re-sends it."""
        seq.out.add(seq.append(token, step_s, now, logprobs))
        self._woken.append(seq.out)
        if seq.finish_reason:
            if self.admission.cache.enabled:
                written = seq.written_tokens()
                self.admission.cache.publish(written, seq.block_table, len(written), seq.cache_salt)
            self.decode.leave(seq)
            return True
        return False

    def prompt_done(self, seq: RequestSequence, token: int, step_s: float, now: float,
                    logprobs: TokenLogprobs | None = None) -> None:
        """The prompt's KV is in the pool (or queued on the engine's stream): its full blocks may serve
        others, and its first token goes out; then it waits for a batch slot, unless that token was its last."""
        self.admission.cache.publish(seq.prompt, seq.block_table, len(seq.prompt), seq.cache_salt)
        if not self.append(seq, token, step_s, now, logprobs):
            self.ready.append(seq)

    def refuse(self, seq: RequestSequence, rejected: Rejected) -> None:
        """A local prefill failed: the request hears why and its blocks go back."""
        seq.out.add(rejected)
        self._woken.append(seq.out)
        self.admission.release(seq)

    def _drop_cancelled(self) -> None:
        self.local.drop_cancelled()
        for seq in [s for s in self.ready if s.cancelled.is_set()]:
            self.ready.remove(seq)
            self.admission.release(seq)
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self.running.remove(seq)
            self.decode.leave(seq)

    def step(self) -> None:
        # schedule
        idle = not (self.local.prefilling or self.ready or self.running or self.decode.in_flight)
        self.take_arrivals(wait_s=0.5 if idle else 0.0)
        self._drop_cancelled()
        while self.ready and len(self.running) < self.max_batch_size:
            self.running.append(self.ready.popleft())
        # run + postprocess
        if self.local.prefilling:
            self.local.run_head()
            self._wake_readers()  # the first token leaves before the decode step runs
        if self.running or self.decode.in_flight is not None:
            finished = self.decode.run(self.running)
            if finished:
                self.running = [s for s in self.running if id(s) not in finished]
            self._wake_readers()
        if self.die_after_steps is not None and self.steps >= self.die_after_steps:
            raise RuntimeError(f"fault injection: PD_FAULT_ENGINE_DIE_AFTER_STEPS={self.die_after_steps} reached")
