"""Prompts prefilled on the decode server itself, on the engine thread between decode steps: the
whole prompt in one piece (colocated), a chunk a step (chunked), a slice of the model's layers over
the whole prompt a step (layered). A partitioned prompt goes to the partitioned-prefill thread
(decode_server.partitioned) and comes back through the scheduler's inbox as a `PrefillDone`.

Each prompt's end goes to the scheduler through `PromptSink`: its first token, or its refusal.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from decode_server import metrics
from decode_server.admission import Admission
from decode_server.config import CHUNK_SIZES, PrefillMode
from decode_server.partitioned import PartitionedPrefill, PrefillDone
from decode_server.row_sampling import sample_rows
from decode_server.sequence import Rejected, RequestSequence
from decode_server.step_trace import StepTrace
from engine.green_context import SmPartitions
from engine.host_read import TokenReader
from engine.logprobs import StepLogprobs, TokenLogprobs, device_tensor
from engine.runner import ModelRunner
from engine.warmup import WarmUp
from serving.token_ids import as_array

log = logging.getLogger(__name__)


class PromptSink(Protocol):
    """Where a prompt prefilled here goes at its end (the scheduler)."""

    def prompt_done(self, seq: RequestSequence, token: int, step_s: float, now: float,
                    logprobs: TokenLogprobs | None = None) -> None:
        """Its KV is in the pool (or queued on the engine's stream) and `token` is its first."""

    def refuse(self, seq: RequestSequence, rejected: Rejected) -> None:
        """Its prefill failed: the request ends with `rejected` and its blocks go back."""


@dataclass
class LayeredPrefill:
    """The head prompt's prefill under way in layered mode: one slice of layers an engine step."""

    seq: RequestSequence
    slices: Iterator[torch.Tensor | None]  # ModelRunner.prefill_slices
    started: float


class LocalPrefill:
    """The prompts waiting for a local prefill, first in first out, and the one piece of work a
    scheduler step gives the head among them."""

    def __init__(self, runner: ModelRunner, admission: Admission, sink: PromptSink, max_batch_size: int,
                 layer_slice_tokens: int, partitions: SmPartitions | None, prefill_sms: int,
                 post_done: Callable[[PrefillDone], None], trace: StepTrace | None = None,
                 partitioned_short_first: bool = False) -> None:
        """`partitions` and `prefill_sms`: where partitioned prompts are prefilled, beside the decode
        steps (their `PrefillDone` goes to `post_done`); without them a partitioned prompt is
        prefilled as a layered one. `partitioned_short_first`: `PartitionedPrefill`'s `short_first`."""
        self.runner, self.admission, self.sink = runner, admission, sink
        self.layer_slice_tokens = layer_slice_tokens  # layered mode: prompt tokens x layers a slice
        self.prefilling: deque[RequestSequence] = deque()  # on this thread, FIFO
        self.layered: LayeredPrefill | None = None
        self.partitioned = (PartitionedPrefill(runner, partitions, prefill_sms, post_done, trace,
                                               partitioned_short_first) if partitions is not None else None)
        self.in_partition: list[RequestSequence] = []  # on the partitioned-prefill thread; freed on its PrefillDone
        self.first_tokens = TokenReader(runner.device, max(1, max_batch_size))  # engine thread only

    @property
    def waiting(self) -> int:
        return len(self.prefilling) + len(self.in_partition)

    def check_prefill_sms(self, num_sms: int) -> str | None:
        """Why a request can't have its partitioned prefill on `num_sms` SMs; None if it can, or if
        this server prefills partitioned prompts as layered ones (no green contexts)."""
        return None if self.partitioned is None else self.partitioned.partitions.check(num_sms)

    def warm_up(self) -> None:
        """Run every local prefill path once (engine.warmup), on the engine thread before serving."""
        warm = WarmUp(self.runner)
        warm.run("whole prompts", warm.whole_prompts)
        warm.run(f"chunks of {CHUNK_SIZES[0]}-{CHUNK_SIZES[-1]} tokens", lambda: warm.chunks(CHUNK_SIZES))
        warm.run("layer slices", lambda: warm.layer_slices(self.layer_slice_tokens))
        warm.run("sampling", lambda: warm.sampling(self.first_tokens))

    def add(self, seq: RequestSequence) -> None:
        if seq.mode == PrefillMode.PARTITIONED and self.partitioned is not None:
            self.in_partition.append(seq)
            self.partitioned.submit(seq)
        else:
            self.prefilling.append(seq)

    def drop_cancelled(self) -> None:
        for seq in [s for s in self.prefilling if s.cancelled.is_set()]:
            self.prefilling.remove(seq)
            if self.layered is not None and self.layered.seq is seq:
                self.layered = None  # its slices so far are queued before any later use of its blocks
            self.admission.release(seq)

    def run_head(self) -> None:
        """One piece of the head prompt's prefill: a layer slice (layered, or partitioned without
        green contexts), else the whole prompt or its next chunk."""
        head = self.prefilling[0]
        if head.mode in (PrefillMode.LAYERED, PrefillMode.PARTITIONED):
            self._prefill_slice(head)
        else:
            self._prefill_piece(head)

    def partition_done(self, done: PrefillDone) -> None:
        """A partitioned prefill's kernels are done: its first token goes out, or its blocks go back."""
        seq = done.seq
        self.in_partition.remove(seq)
        if seq.cancelled.is_set() or (done.token is None and done.error is None):
            self.admission.release(seq)
        elif done.error is not None:
            self._refuse(seq, done.error)
        else:
            assert done.token is not None
            seq.prefilled = len(seq.prompt)
            seq.timing.prefill_s += done.finished - done.started
            metrics.PREFILL_SECONDS.observe(seq.timing.prefill_s)
            # its kernels are done (the partitioned thread waited for them)
            self.sink.prompt_done(seq, done.token, done.finished - done.started, time.perf_counter())

    def _prefill_piece(self, seq: RequestSequence) -> None:
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
            self._head_failed(seq, e)
            return
        seq.prefilled += len(piece)
        if seq.prefilled < len(seq.prompt):
            if self.runner.device.type == "cuda":  # a chunk is one scheduled unit of work; this stream only,
                torch.cuda.current_stream(self.runner.device).synchronize()  # not a partitioned prefill's
            seq.timing.prefill_s += time.perf_counter() - t0
            return
        self._first_token(seq, logits, t0)

    def _prefill_slice(self, seq: RequestSequence) -> None:
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
            self._head_failed(seq, e)
            return
        if logits is None:
            return
        self.layered = None
        seq.prefilled = len(seq.prompt)
        self._first_token(seq, logits, started)

    def _head_failed(self, seq: RequestSequence, error: Exception) -> None:
        """One prompt's prefill failed: that request fails, the batch goes on."""
        self.prefilling.popleft()
        self._refuse(seq, error)

    def _refuse(self, seq: RequestSequence, error: Exception) -> None:
        if isinstance(error, torch.cuda.OutOfMemoryError):
            self.sink.refuse(seq, Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"out of device memory in prefill: {error}"))
            return
        log.error("local prefill of %s failed", seq.request_id, exc_info=error)
        self.sink.refuse(seq, Rejected(grpc.StatusCode.INTERNAL, f"prefill failed: {type(error).__name__}: {error}"))

    def _prompt_logprobs(self, seq: RequestSequence, logits: torch.Tensor, start: int) -> torch.Tensor:
        """A piece's every-token logits [T, V]: the log probabilities of the prompt tokens they
        predict go to seq; the last row's logits [V] are returned."""
        prompt = as_array(seq.prompt)
        targets = prompt[start + 1:start + len(logits) + 1]  # the last piece's last row predicts the answer
        if len(targets):
            rows = logits[:len(targets)]
            queued = StepLogprobs.queue(rows, device_tensor(targets, torch.long, rows.device),
                                        [seq.prompt_logprobs] * len(targets), rank=seq.prompt_ranks)
            assert queued is not None
            seq.prompt_logprob_values.extend(lp for lp in queued.read(len(targets)) if lp is not None)
        return logits[-1]

    def _first_token(self, seq: RequestSequence, logits: torch.Tensor, started: float) -> None:
        """The prompt's prefill (or its last piece, begun at perf_counter `started`) is queued and seq
        is the head of `prefilling`: sample its first token once the device has it (after its
        penalties and its grammar's mask; its log probabilities are the raw logits')."""
        sampled, logprobs = sample_rows(logits[None], [seq], [0], self.runner.device)
        token = self.first_tokens.read(sampled)[0]
        now = time.perf_counter()
        elapsed = now - started
        seq.timing.prefill_s += elapsed
        metrics.PREFILL_SECONDS.observe(seq.timing.prefill_s)
        self.prefilling.popleft()
        self.sink.prompt_done(seq, token, elapsed, now, logprobs.read(1)[0] if logprobs is not None else None)
