"""Partitioned mode's prefill thread: whole prompts prefilled beside the decode loop, on a share of
the SMs.

The scheduler hands a sequence over (`submit`) and keeps stepping its decode batch on the primary
context with its CUDA graphs. This thread runs one prefill at a time inside `SmPartitions.confine`
(a green context's stream on the GPU), samples the first token there, waits on its own thread for
the device to finish, and posts a `PrefillDone` into the scheduler's inbox, which appends the
token on the engine thread. So the scheduler never waits for a prefill, and a sequence's blocks
are freed only after `PrefillDone` arrives, when no kernel of its prefill is left to write them.

A short prompt (a chat's later turn after its cached prefix) on the server's SM count replays prefill
graphs of this thread's own, captured on that count's green stream at start
(`ModelRunner.partition_graphs`): queued eagerly, its kernels took the host longer than the GPU.

With `short_first`, a short prompt does not wait out a long one. Between two layers of a prompt of more than
`YIELDING_PROMPT_TOKENS` new tokens, the thread prefills every prompt of at most `SHORT_PROMPT_TOKENS`
queued by then and posts its first token, then goes on with the next layer; the other prompts keep their
order. So that a layer boundary on the host is one on the device too, such a prefill waits for each
layer's kernels before it queues the next: its layers take milliseconds on the device, where queueing
the next one's first kernel takes microseconds.

What the two threads share: the model's weights (read only) and the KV pool, where this thread
writes only the blocks of the sequence it prefills and the decode graphs read only the running
sequences' blocks. Each thread keeps its own cuDNN/cuBLAS handles (PyTorch keeps them per thread),
its own stream and so its own caching-allocator pool, and its own pinned buffer for the token.
Only this thread waits for the device here, on its stream alone: the decode stream never waits for
a prefill.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decode_server.sequence import RequestSequence
from decode_server.step_trace import StepTrace
from engine.green_context import SmPartitions
from engine.prefill_graphs import PrefillGraphs
from engine.runner import ModelRunner
from engine.sampling import sample
from serving.grpc_common import StartupError

log = logging.getLogger(__name__)

SHORT_PROMPT_TOKENS = 512  # new tokens of a prompt that may run between a long prompt's layers
YIELDING_PROMPT_TOKENS = 2048  # new tokens of a prompt past which it lets the short ones in between its layers


class _Cancelled(Exception):
    """The sequence was cancelled while its prefill was being queued: queue no more layers."""


@dataclass
class PrefillDone:
    """A partitioned prefill ended, its kernels finished: the first token, or why there is none."""

    seq: RequestSequence
    token: int | None
    error: Exception | None  # None with no token: it was cancelled
    started: float           # perf_counter when the prefill began on the device's share
    finished: float


class PartitionedPrefill:
    def __init__(self, runner: ModelRunner, partitions: SmPartitions, default_sms: int,
                 post: Callable[[PrefillDone], None], trace: StepTrace | None = None,
                 short_first: bool = False) -> None:
        self.runner, self.partitions, self.default_sms, self.post = runner, partitions, default_sms, post
        self.short_first = short_first
        self.trace = trace
        self._jobs: queue.Queue[RequestSequence | None] = queue.Queue()
        self._deferred: deque[RequestSequence | None] = deque()  # taken from _jobs mid-prefill, not yet run
        self.graphs: PrefillGraphs | None = None  # replayed on the green stream of `default_sms`
        self._ready = threading.Event()
        self._setup_failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="partitioned-prefill")

    def start(self) -> None:
        """Start the thread; returns once it has its cuDNN plans (and the default green context), and
        raises what stopped it from getting them."""
        self._thread.start()
        self._ready.wait()
        if self._setup_failed is not None:
            raise StartupError(f"the partitioned prefill thread could not start: "
                               f"{type(self._setup_failed).__name__}: {self._setup_failed}")

    def stop(self) -> None:
        self._jobs.put_nowait(None)
        self._thread.join(timeout=10)

    def submit(self, seq: RequestSequence) -> None:
        """From the engine thread: prefill `seq` after those submitted before it."""
        self._jobs.put_nowait(seq)

    def sms_for(self, seq: RequestSequence) -> int:
        return seq.prefill_sms or self.default_sms

    def _loop(self) -> None:
        try:
            self.runner.bind_thread()
            with self.partitions.confine(self.default_sms):
                self.runner.prepare_engine_thread()  # this thread's cuDNN plans, built under its own stream
                if self.partitions.streams_of_their_own:
                    self.graphs = self._capture_graphs()
            # the first token comes back through pinned memory and a wait on the green stream alone (no
            # event: recording one made on the primary context on a green context's stream is not portable)
            host = torch.empty(1, dtype=torch.long, pin_memory=self.runner.device.type == "cuda")
        except BaseException as e:
            self._setup_failed = e
            return
        finally:
            self._ready.set()
        while (seq := self._deferred.popleft() if self._deferred else self._jobs.get()) is not None:
            self.post(self._prefill(seq, host))
        if self.graphs is not None:
            self.runner.release_partition_graphs(self.graphs)  # before the green context can go
            self.graphs = None

    def _capture_graphs(self) -> PrefillGraphs | None:
        """This thread's prefill graphs, or None (its prefills then run eagerly, as they can) where the
        driver will not capture on the green stream."""
        try:
            return self.runner.partition_graphs()
        except RuntimeError as e:
            log.warning("the partitioned prefill thread could not capture its prefill graphs on its green "
                        "context's stream (%s): its prefills run eagerly", e)
            if self.runner.device.type == "cuda":
                torch.cuda.synchronize(self.runner.device)
            return None

    def _short_ones_between_layers(self, host: torch.Tensor) -> None:
        """Inside a long prefill, after a layer: prefill the short prompts queued by now and post their
        tokens; the long ones queued meanwhile keep their order behind it."""
        shorts: list[RequestSequence] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and _new_tokens(job) <= SHORT_PROMPT_TOKENS:
                shorts.append(job)
            else:
                self._deferred.append(job)
        for job in shorts:
            self.post(self._prefill(job, host))

    def _prefill(self, seq: RequestSequence, host: torch.Tensor) -> PrefillDone:
        started = time.perf_counter()
        if seq.cancelled.is_set():
            return PrefillDone(seq, None, None, started, started)
        long_prompt = self.short_first and _new_tokens(seq) > YIELDING_PROMPT_TOKENS
        cuda = self.runner.device.type == "cuda"

        def between_layers(_layer: int) -> None:
            if seq.cancelled.is_set():
                raise _Cancelled
            if long_prompt:
                if cuda:  # the layer's kernels done, so a short prompt's come right after them
                    torch.cuda.current_stream(self.runner.device).synchronize()
                self._short_ones_between_layers(host)

        token: int | None = None
        error: Exception | None = None
        queued = started
        sms = self.sms_for(seq)
        try:
            with self.partitions.confine(sms):
                try:
                    # this thread's own graphs, captured on this SM count's stream; never the engine thread's
                    graphs = self.graphs if self.graphs is not None and sms == self.default_sms else False
                    logits = self.runner.prefill(seq.uncached_prompt(), seq.block_table, seq.prefilled,
                                                 on_layer_done=between_layers, graphed=graphs)
                    host.copy_(sample(logits[None], [seq.params], [0]), non_blocking=True)
                    queued = time.perf_counter()
                finally:  # whatever was queued must finish before the scheduler may free the blocks
                    if cuda:
                        torch.cuda.current_stream(self.runner.device).synchronize()
                token = int(host[0])
        except _Cancelled:
            pass
        except Exception as e:  # this request fails; the thread goes on with the next
            error = e
        finished = time.perf_counter()
        if self.trace is not None:
            self.trace.prefill(seq.request_id, _new_tokens(seq), sms, started, queued, finished)
        return PrefillDone(seq, token, error, started, finished)


def _new_tokens(seq: RequestSequence) -> int:
    """The prompt's tokens a local prefill computes (after its cached prefix)."""
    return len(seq.prompt) - seq.prefilled
