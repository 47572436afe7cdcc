"""The decode server's batch loop: continuous batching over the KV pool, on its own thread.

Each iteration of `step()` reads as schedule, run, postprocess:
- schedule: take arrivals from the inbox (a prompt to prefill here, a prompt prefilled elsewhere
  with its first token, a cancelled request to let go), drop cancelled sequences, admit ready
  sequences into the running batch up to --max-batch-size;
- run: at most one local prefill piece (a whole prompt when colocated, one chunk when chunked, a
  slice of the model's layers over the whole prompt when layered), then one decode step for every
  running sequence; a partitioned prompt is prefilled meanwhile on the partitioned-prefill thread
  (decode_server.partitioned), whose `PrefillDone` comes back through the inbox;
- postprocess: each sampled token goes into its request's `RequestOutput`, and the readers on
  the event loop are woken once for the step; finished sequences leave and give their KV blocks
  back (`Admission.release`, called from here only).

From `submit` on, the sequence and its blocks belong to this loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from decode_server import metrics
from decode_server.admission import Admission
from decode_server.config import CHUNK_SIZES, PrefillMode
from decode_server.partitioned import PartitionedPrefill, PrefillDone
from decode_server.sequence import Rejected, RequestOutput, Sequence
from engine import penalties
from engine.green_context import SmPartitions
from engine.host_read import TokenReader
from engine.logprobs import StepLogprobs, TokenLogprobs, device_tensor
from engine.penalties import PenaltyState
from engine.runner import DecodeSeq, ModelRunner
from engine.sampling import sample
from engine.warmup import WarmUp
from serving.token_ids import as_array

log = logging.getLogger(__name__)

# While a remote prefill is under way, a decode step waits for its tokens in slices this long,
# taking handed-over first tokens in between: they leave at once, not after the step.
HANDOVER_POLL_S = 0.0002


@dataclass
class LayeredPrefill:
    """The head prompt's prefill under way in layered mode: one slice of layers an engine step."""

    seq: Sequence
    slices: Iterator[torch.Tensor | None]  # ModelRunner.prefill_slices
    started: float


@dataclass
class _StepInFlight:
    """A decode step queued on the device whose tokens are not yet read back (overlapped steps)."""

    seqs: list[Sequence]          # its rows, in order
    tokens: torch.Tensor          # its sampled tokens on the device: the next step's inputs
    reader: TokenReader
    started: float
    rows: dict[int, int] = field(init=False)                     # id(seq) -> row
    release_after: list[Sequence] = field(default_factory=list)  # blocks it still writes: freed once it is done
    logprobs: StepLogprobs | None = None                         # of the rows that asked for them

    def __post_init__(self) -> None:
        self.rows = {id(s): i for i, s in enumerate(self.seqs)}


@dataclass
class _Arrival:
    seq: Sequence
    first_token: int | None  # sampled by a prefill server; None: prefill here


class BatchScheduler:
    def __init__(self, runner: ModelRunner, admission: Admission, max_batch_size: int,
                 layer_slice_tokens: int = 32768, die_after_steps: int | None = None,
                 partitions: SmPartitions | None = None, prefill_sms: int = 0, warm_up: bool = False,
                 overlap_steps: bool = True) -> None:
        """`partitions` and `prefill_sms`: where partitioned prompts are prefilled, beside the decode
        steps; without them a partitioned prompt is prefilled as a layered one. `warm_up`: run every
        local prefill path once before `start` returns (engine.warmup). `overlap_steps`: queue each
        decode step before the last one's tokens are read back (see `_decode_step`)."""
        self.runner = runner
        self.warm_up = warm_up
        self.admission = admission
        self.loop = admission.loop  # where the outputs' readers run
        self.max_batch_size = max_batch_size
        self.layer_slice_tokens = layer_slice_tokens  # layered mode: prompt tokens x layers a slice
        self.die_after_steps = die_after_steps  # fault injection (PD_FAULT_ENGINE_DIE_AFTER_STEPS)
        self._submit_lock = threading.Lock()       # orders submit() against the loop's death
        self._inbox: queue.Queue[_Arrival | PrefillDone | None] = queue.Queue()
        self.prefilling: deque[Sequence] = deque()  # local prefill, FIFO
        self.ready: deque[Sequence] = deque()       # first token out, waiting for a batch slot
        self.running: list[Sequence] = []
        self.layered: LayeredPrefill | None = None
        self.partitioned = (PartitionedPrefill(runner, partitions, prefill_sms, self._inbox.put_nowait)
                            if partitions is not None else None)
        self.in_partition: list[Sequence] = []     # on the partitioned-prefill thread; blocks freed on its PrefillDone
        self._woken: list[RequestOutput] = []       # outputs added since the last wake-up
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="decode-engine")
        self.failed: BaseException | None = None
        self.on_failure: list[Callable[[], object]] = []  # run on this thread if the loop dies
        self.steps = 0
        self._handovers = 0  # remote prefills whose first token may be handed over (expect_handover)
        self._handover_lock = threading.Lock()
        # used on the engine thread only: first tokens, and two for decode steps (one may be in flight)
        self._tokens = TokenReader(runner.device, max(1, max_batch_size))
        self._step_readers = [TokenReader(runner.device, max(1, max_batch_size)) for _ in range(2)]
        self.overlap_steps = overlap_steps
        self._in_flight: _StepInFlight | None = None
        self._launched = 0
        self._tokens_at = 0.0  # when the last decode step's tokens were read back

    # --- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once it is ready to run requests."""
        if self.partitioned is not None:
            self.partitioned.start()
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put_nowait(None)
        self._thread.join(timeout=10)
        if self.partitioned is not None:
            self.partitioned.stop()

    def submit(self, seq: Sequence, first_token: int | None = None) -> None:
        """Hand an admitted sequence over: to prefill here, or (`first_token` given) prefilled by a
        prefill server, its KV in the pool; its first token is appended on the engine thread like
        any other. A cancelled sequence is only let go (its blocks freed).

        If the engine has died, the sequence gets its error at once (and its blocks go back)
        instead of waiting for a loop that is gone."""
        with self._submit_lock:
            if self.failed is None:
                self._inbox.put_nowait(_Arrival(seq, first_token))
                return
        self._fail(seq, self.failed)

    def let_go(self, seq: Sequence) -> None:
        """An admitted sequence that ends before it was submitted (its remote prefill failed, or it
        was cancelled): the loop frees its blocks."""
        seq.cancelled.set()
        self.submit(seq)

    def expect_handover(self) -> None:
        """A remote prefill began (event loop): until its first token is submitted, or it ends
        without one (`handover_ended`), decode steps look for that token while they run."""
        with self._handover_lock:
            self._handovers += 1

    def handover_ended(self) -> None:
        with self._handover_lock:
            self._handovers -= 1

    def check_prefill_sms(self, num_sms: int) -> str | None:
        """Why a request can't have its partitioned prefill on `num_sms` SMs; None if it can, or if
        this server prefills partitioned prompts as layered ones (no green contexts)."""
        return None if self.partitioned is None else self.partitioned.partitions.check(num_sms)

    @property
    def step_in_flight(self) -> bool:
        """An overlapped decode step is queued whose tokens (and held blocks) the loop has yet to take."""
        return self._in_flight is not None

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + len(self.prefilling) + len(self.ready) + len(self.in_partition)

    # --- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            try:
                self.runner.prepare_engine_thread()
                if self.warm_up:
                    self._warm_up()
            finally:
                self._ready.set()
            while not self._stop.is_set():
                self.step()
        except BaseException as e:  # the engine is gone: health must say so and the process exit
            log.exception("decode engine loop died")
            self._wake_readers()  # tokens already out, a last one among them
            with self._submit_lock:
                self.failed = e
            if self._in_flight is not None:
                for seq in self._in_flight.release_after:
                    self.admission.release(seq)
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
                    stranded.append(item.seq)
            for seq in stranded:
                self._fail(seq, e)
            for seq in self.in_partition:  # its prefill may still write its blocks: they stay out of circulation
                self._fail(seq, e, release=False)
            for callback in self.on_failure:
                callback()

    def _warm_up(self) -> None:
        warm = WarmUp(self.runner)
        warm.run("whole prompts", warm.whole_prompts)
        warm.run(f"chunks of {CHUNK_SIZES[0]}-{CHUNK_SIZES[-1]} tokens", lambda: warm.chunks(CHUNK_SIZES))
        warm.run("layer slices", lambda: warm.layer_slices(self.layer_slice_tokens))
        warm.run("sampling", lambda: warm.sampling(self._tokens))

    def _fail(self, seq: Sequence, error: BaseException, release: bool = True) -> None:
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

    def _take_inbox(self, wait_s: float = 0.0) -> None:
        """Take every arrival, waiting up to `wait_s` for the first; wake the readers of what came out."""
        try:
            item = self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait()
            while True:
                if isinstance(item, PrefillDone):
                    self._partition_done(item)
                elif item is not None:
                    self._arrive(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        self._wake_readers()

    def _arrive(self, arrival: _Arrival) -> None:
        seq = arrival.seq
        if arrival.first_token is not None:
            self.handover_ended()
        if seq.cancelled.is_set():
            self.admission.release(seq)
        elif arrival.first_token is None and seq.mode == PrefillMode.PARTITIONED and self.partitioned is not None:
            self.in_partition.append(seq)
            self.partitioned.submit(seq)
        elif arrival.first_token is None:
            self.prefilling.append(seq)
        else:
            now = time.perf_counter()  # its KV is in the pool: the handoff completed before submit
            self._prompt_done(seq, arrival.first_token, now - seq.timing.admitted, now)

    def _append(self, seq: Sequence, token: int, step_s: float, now: float,
                logprobs: TokenLogprobs | None = None) -> bool:
        """Record a token and send it; True (and the sequence's blocks given back) if it was the last.
        A finished sequence's blocks stay cached with its answer in them: a chat's next turn re-sends it."""
        seq.out.add(seq.append(token, step_s, now, logprobs))
        self._woken.append(seq.out)
        if seq.finish_reason:
            if self.admission.cache.enabled:
                written = seq.written_tokens()
                self.admission.cache.publish(written, seq.block_table, len(written))
            self._release(seq)
            return True
        return False

    def _release(self, seq: Sequence) -> None:
        """A running sequence leaves: its blocks go back, once no queued step writes them any more (an
        overlapped step in flight writes one more token of it, which nobody reads)."""
        step = self._in_flight
        if step is not None and id(seq) in step.rows:
            step.release_after.append(seq)
        else:
            self.admission.release(seq)

    def _prompt_done(self, seq: Sequence, token: int, step_s: float, now: float,
                     logprobs: TokenLogprobs | None = None) -> None:
        """The prompt's KV is in the pool (or queued on the engine's stream): its full blocks may serve
        others, and its first token goes out; then it waits for a batch slot, unless that token was its last."""
        self.admission.cache.publish(seq.prompt, seq.block_table, len(seq.prompt))
        if not self._append(seq, token, step_s, now, logprobs):
            self.ready.append(seq)

    def _drop_cancelled(self) -> None:
        for group in (self.prefilling, self.ready):
            for seq in [s for s in group if s.cancelled.is_set()]:
                group.remove(seq)
                if self.layered is not None and self.layered.seq is seq:
                    self.layered = None  # its slices so far are queued before any later use of its blocks
                self.admission.release(seq)
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self.running.remove(seq)
            self._release(seq)

    def step(self) -> None:
        # schedule
        idle = not (self.prefilling or self.ready or self.running or self._in_flight)
        self._take_inbox(wait_s=0.5 if idle else 0.0)
        self._drop_cancelled()
        while self.ready and len(self.running) < self.max_batch_size:
            self.running.append(self.ready.popleft())
        # run + postprocess
        if self.prefilling:
            head = self.prefilling[0]
            if head.mode in (PrefillMode.LAYERED, PrefillMode.PARTITIONED):  # partitioned: no green contexts here
                self._prefill_slice(head)
            else:
                self._prefill_piece(head)
            self._wake_readers()  # the first token leaves before the decode step runs
        if self.running or self._in_flight is not None:
            self._decode_step()
            self._wake_readers()
        if self.die_after_steps is not None and self.steps >= self.die_after_steps:
            raise RuntimeError(f"fault injection: PD_FAULT_ENGINE_DIE_AFTER_STEPS={self.die_after_steps} reached")

    def _prefill_piece(self, seq: Sequence) -> None:
        """The whole prompt (colocated) or its next chunk (chunked); samples the first token at the end."""
        size = seq.chunk_size if seq.mode == PrefillMode.CHUNKED else len(seq.prompt)
        start = seq.prefilled
        piece = as_array(seq.prompt)[start:start + size]
        t0 = time.perf_counter()
        try:
            logits = self.runner.prefill(piece, seq.block_table, start, every_token=seq.prompt_logprobs is not None)
            if seq.prompt_logprobs is not None:
                logits = self._prompt_logprobs(seq, logits, start)
        except Exception as e:
            self._prefill_failed(seq, e)
            return
        seq.prefilled += len(piece)
        if seq.prefilled < len(seq.prompt):
            if self.runner.device.type == "cuda":  # a chunk is one scheduled unit of work; this stream only,
                torch.cuda.current_stream(self.runner.device).synchronize()  # not a partitioned prefill's
            seq.timing.prefill_s += time.perf_counter() - t0
            return
        self._first_token(seq, logits, t0)

    def _prefill_slice(self, seq: Sequence) -> None:
        """The next slice of the model's layers over the whole prompt (layered); queued, not waited
        for: the decode step after it waits for both. The last slice samples the first token."""
        if self.layered is None or self.layered.seq is not seq:
            slices = self.runner.prefill_slices(seq.uncached_prompt(), seq.block_table, self.layer_slice_tokens,
                                                seq.prefilled)
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

    def _partition_done(self, done: PrefillDone) -> None:
        """A partitioned prefill's kernels are done: its first token goes out, or its blocks go back."""
        seq = done.seq
        self.in_partition.remove(seq)
        if seq.cancelled.is_set() or (done.token is None and done.error is None):
            self.admission.release(seq)
        elif done.error is not None:
            self._reject_prefill(seq, done.error)
        else:
            assert done.token is not None
            seq.prefilled = len(seq.prompt)
            seq.timing.prefill_s += done.finished - done.started
            metrics.PREFILL_SECONDS.observe(seq.timing.prefill_s)
            # its kernels are done (the partitioned thread waited for them)
            self._prompt_done(seq, done.token, done.finished - done.started, time.perf_counter())

    def _prefill_failed(self, seq: Sequence, error: Exception) -> None:
        """One prompt's prefill failed: that request fails, the batch goes on."""
        self.prefilling.popleft()
        self._reject_prefill(seq, error)

    def _reject_prefill(self, seq: Sequence, error: Exception) -> None:
        if isinstance(error, torch.cuda.OutOfMemoryError):
            seq.out.add(Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory in prefill: {error}"))
        else:
            log.error("local prefill of %s failed", seq.request_id, exc_info=error)
            seq.out.add(Rejected(grpc.StatusCode.INTERNAL, f"prefill failed: {type(error).__name__}: {error}"))
        self._woken.append(seq.out)
        self.admission.release(seq)

    def _penalty_states(self, seqs: list[Sequence], vocab: int) -> list[PenaltyState | None]:
        """Each sequence's penalties on the device (made at its first use), None where it has none."""
        for seq in seqs:
            if seq.penalties is not None and seq.penalty_state is None:
                seq.penalty_state = PenaltyState.create(seq.penalties, as_array(seq.prompt),
                                                        sorted(seq.eos_ids | seq.stop_ids), vocab, self.runner.device)
        return [seq.penalty_state for seq in seqs]

    def _prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> torch.Tensor:
        """A piece's every-token logits [T, V]: the log probabilities of the prompt tokens they
        predict go to seq; the last row's logits [V] are returned."""
        prompt = as_array(seq.prompt)
        targets = prompt[start + 1:start + len(logits) + 1]  # the last piece's last row predicts the answer
        if len(targets):
            rows = logits[:len(targets)]
            queued = StepLogprobs.queue(rows, device_tensor(targets, torch.long, rows.device),
                                        [seq.prompt_logprobs] * len(targets))
            assert queued is not None
            seq.prompt_logprob_values.extend(lp for lp in queued.read(len(targets)) if lp is not None)
        return logits[-1]

    def _first_token(self, seq: Sequence, logits: torch.Tensor, started: float) -> None:
        """The prompt's prefill (or its last piece, begun at perf_counter `started`) is queued and seq
        is the head of `prefilling`: sample its first token once the device has it."""
        states = self._penalty_states([seq], logits.shape[-1])
        adjusted, _ = penalties.apply(logits[None], states, [seq.params.temperature], [0])
        sampled = sample(adjusted, [seq.params], [0])
        penalties.count(states, sampled)
        logprobs = StepLogprobs.queue(logits[None], sampled, [seq.logprobs])
        token = self._tokens.read(sampled)[0]
        now = time.perf_counter()
        elapsed = now - started
        seq.timing.prefill_s += elapsed
        metrics.PREFILL_SECONDS.observe(seq.timing.prefill_s)
        self.prefilling.popleft()
        self._prompt_done(seq, token, elapsed, now, logprobs.read(1)[0] if logprobs is not None else None)

    def _decode_step(self) -> None:
        """One decode step for the running sequences. Overlapped: the step is queued before the
        previous step's tokens are read back, its rows taking those tokens on the device, so the GPU
        never waits while the host reads tokens and prepares the next step's metadata (vLLM's
        async scheduling, SGLang's overlap scheduler). The cost: a sequence that ends on a stop or
        EOS token has one more row computed in the step queued meanwhile, which nobody reads."""
        previous, self._in_flight = self._in_flight, None
        if not self.overlap_steps:
            if self.running:
                self._read_step(self._launch(self.running, None))
            return
        # a sequence whose length ends it with the previous step's token has no next step
        seqs = [s for s in self.running
                if previous is None or id(s) not in previous.rows or len(s.tokens) + 1 < s.max_new_tokens]
        if seqs:
            self._in_flight = self._launch(seqs, previous)
        if previous is not None:
            self._read_step(previous)

    def _launch(self, seqs: list[Sequence], previous: _StepInFlight | None) -> _StepInFlight:
        """Queue a decode step of `seqs` and the read-back of its tokens; a sequence in `previous`
        takes its input token from that step's tokens, still on the device."""
        t0 = time.perf_counter()
        rows = previous.rows if previous is not None else {}
        batch, indices = [], []
        for s in seqs:
            row = rows.get(id(s), -1)
            produced = len(s.tokens) + (row >= 0)  # its tokens once `previous` is read
            batch.append(DecodeSeq(s.tokens[-1] if row < 0 else 0, len(s.prompt) + produced - 1, s.block_table, row))
            indices.append(produced)
        logits, greedy = self.runner.decode(batch, previous.tokens if previous is not None else None)
        states = self._penalty_states(seqs, logits.shape[-1])
        adjusted, changed = penalties.apply(logits, states, [s.params.temperature for s in seqs], indices)
        if changed:  # the fused argmax is of the logits before the penalties
            penalised = device_tensor(changed, torch.long, greedy.device)
            greedy = greedy.clone()
            greedy[penalised] = adjusted.index_select(0, penalised).argmax(dim=-1).to(greedy.dtype)
        tokens = sample(adjusted, [s.params for s in seqs], indices, greedy)
        penalties.count(states, tokens)
        logprobs = StepLogprobs.queue(logits, tokens, [s.logprobs for s in seqs])
        self._launched += 1
        reader = self._step_readers[self._launched % 2]  # the other may hold the step in flight
        reader.start(tokens)
        return _StepInFlight(seqs, tokens, reader, t0, logprobs=logprobs)

    def _read_step(self, step: _StepInFlight) -> None:
        """Wait for a queued step's tokens and hand them out; a row whose sequence has left since (it
        ended on the step before, or was cancelled) is dropped."""
        while self._handovers and not step.reader.ready():
            self._take_inbox(wait_s=HANDOVER_POLL_S)  # a handed-over first token leaves now, not after the step
        tokens = step.reader.take()
        now = time.perf_counter()
        elapsed = now - max(step.started, self._tokens_at)  # from the later of its launch and the last tokens out
        self._tokens_at = now
        self.steps += 1
        metrics.DECODE_STEP.observe(elapsed)
        for seq in step.release_after:
            self.admission.release(seq)
        live = {id(s) for s in self.running}
        logprobs = step.logprobs.read(len(tokens)) if step.logprobs is not None else [None] * len(tokens)
        finished = {id(seq) for seq, token, lp in zip(step.seqs, tokens, logprobs, strict=True)
                    if id(seq) in live and self._append(seq, token, elapsed, now, lp)}
        if finished:
            self.running = [s for s in self.running if id(s) not in finished]
