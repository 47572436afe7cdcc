"""The decode steps over the running batch, on the engine thread. Overlapped (`--overlap-steps`, the
default): a step is queued before the previous step's tokens are read back, its rows taking those
tokens on the device, so the GPU never waits while the host reads tokens and prepares the next
step's metadata (vLLM's async scheduling, SGLang's overlap scheduler). The cost: a sequence that ends
on a stop or EOS token has one more row computed in the step queued meanwhile, which nobody reads;
its blocks go back once that step is done (`leave`). While a sequence with a grammar (structured
outputs) runs, a step's forward is queued first, the step before is read while the device computes
it (its tokens advance the grammars' matchers), and then the step's sampling is queued with the
masks they give: only the sampling waits for the host, not the forward.

Each token read back goes to the scheduler through `TokenSink`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from decode_server import metrics
from decode_server.admission import Admission
from decode_server.row_sampling import sample_rows
from decode_server.sequence import RequestSequence
from decode_server.step_trace import StepMarks, StepTrace
from engine.host_read import TokenReader
from engine.logprobs import StepLogprobs, TokenLogprobs
from engine.runner import DecodeSeq, ModelRunner

# While a remote prefill is under way, a decode step waits for its tokens in slices this long,
# taking arrived first tokens in between: they leave at once, not after the step.
FIRST_TOKEN_POLL_S = 0.0002


class TokenSink(Protocol):
    """Where a decode step's tokens go (the scheduler)."""

    def append(self, seq: RequestSequence, token: int, step_s: float, now: float,
               logprobs: TokenLogprobs | None = None) -> bool:
        """Record and send a token; True if it was the sequence's last (its blocks then go back)."""

    def remote_first_token_due(self) -> bool:
        """A remote prefill is under way whose first token may arrive while a step runs."""

    def take_arrivals(self, wait_s: float) -> None:
        """Take what arrived, waiting up to `wait_s` for the first."""


@dataclass
class StepInFlight:
    """A decode step queued on the device whose tokens are not yet read back (overlapped steps)."""

    seqs: list[RequestSequence]   # its rows, in order
    reader: TokenReader
    started: float
    marks: StepMarks | None  # --step-trace
    tokens: torch.Tensor | None = None     # its sampled tokens on the device, once sampled: the next step's inputs
    logprobs: StepLogprobs | None = None   # of the rows that asked for them
    rows: dict[int, int] = field(init=False)                            # id(seq) -> row
    release_after: list[RequestSequence] = field(default_factory=list)  # blocks it still writes: freed once done

    def __post_init__(self) -> None:
        self.rows = {id(s): i for i, s in enumerate(self.seqs)}

    def sampled(self) -> torch.Tensor:
        """Its tokens on the device; a step is sampled before the next one is launched."""
        assert self.tokens is not None, "the step in flight has not been sampled"
        return self.tokens


class DecodeSteps:
    def __init__(self, runner: ModelRunner, admission: Admission, sink: TokenSink, max_batch_size: int,
                 overlap: bool = True, trace: StepTrace | None = None) -> None:
        self.runner, self.admission, self.sink = runner, admission, sink
        self.overlap = overlap
        self.trace = trace
        # two readers, used in turn: one may hold the step in flight
        self.readers = [TokenReader(runner.device, max(1, max_batch_size)) for _ in range(2)]
        self.in_flight: StepInFlight | None = None
        self.steps = 0  # steps whose tokens were read back
        self._launched = 0
        self._tokens_at = 0.0  # when the last step's tokens were read back

    def leave(self, seq: RequestSequence) -> None:
        """A running sequence leaves: its blocks go back, once no queued step writes them any more (an
        overlapped step in flight writes one more token of it, which nobody reads)."""
        step = self.in_flight
        if step is not None and id(seq) in step.rows:
            step.release_after.append(seq)
        else:
            self.admission.release(seq)

    def abandon(self) -> None:
        """The engine is gone: the blocks held for the step in flight go back."""
        if self.in_flight is not None:
            for seq in self.in_flight.release_after:
                self.admission.release(seq)

    def run(self, running: list[RequestSequence]) -> set[int]:
        """One decode step for the running sequences (overlapped: queue it, then read the one before).
        Returns the ids of the sequences that finished on the tokens read."""
        previous, self.in_flight = self.in_flight, None
        if not self.overlap:
            return self._read(self._launch(running, None), running) if running else set()
        # a sequence whose length ends it with the previous step's token has no next step
        seqs = [s for s in running
                if previous is None or id(s) not in previous.rows or len(s.tokens) + 1 < s.max_new_tokens]
        if previous is not None and any(s.grammar is not None for s in seqs):
            # a grammar's mask needs the previous token taken by its matcher: read it between the
            # forward and the sampling
            finished: set[int] = set()

            def read_previous() -> None:
                finished.update(self._read(previous, running))

            self._launch(seqs, previous, read_previous)
            return finished
        if seqs:
            self._launch(seqs, previous)
        return self._read(previous, running) if previous is not None else set()

    def _launch(self, seqs: list[RequestSequence], previous: StepInFlight | None,
                before_sampling: Callable[[], None] | None = None) -> StepInFlight:
        """Queue a decode step of `seqs` and the read-back of its tokens; a sequence in `previous`
        takes its input token from that step's tokens, still on the device. `before_sampling` runs
        once the forward is queued, the step already in flight (a sequence that leaves meanwhile
        keeps its blocks until it is done)."""
        t0 = time.perf_counter()
        marks = (self.trace.begin_step([s.request_id for s in seqs[:8]], len(seqs), self.runner.device)
                 if self.trace is not None else None)
        rows = previous.rows if previous is not None else {}
        batch, indices = [], []
        for s in seqs:
            row = rows.get(id(s), -1)
            produced = len(s.tokens) + (row >= 0)  # its tokens once `previous` is read
            batch.append(DecodeSeq(s.tokens[-1] if row < 0 else 0, len(s.prompt) + produced - 1, s.block_table, row))
            indices.append(produced)
        logits, greedy = self.runner.decode(batch, previous.sampled() if previous is not None else None)
        self._launched += 1
        reader = self.readers[self._launched % 2]  # the other may hold the step before
        step = StepInFlight(seqs, reader, t0, marks)  # in flight from here: a row that leaves keeps its blocks
        if self.overlap:
            self.in_flight = step
        if before_sampling is not None:
            before_sampling()
        tokens, step.logprobs = sample_rows(logits, seqs, indices, self.runner.device, greedy)
        step.tokens = tokens
        if marks is not None:
            marks.queued()
        step.reader.start(tokens)
        return step

    def _read(self, step: StepInFlight, running: list[RequestSequence]) -> set[int]:
        """Wait for a queued step's tokens and hand them out; a row whose sequence has left since (it
        ended on the step before, or was cancelled) is dropped."""
        read_s = time.perf_counter()
        while self.sink.remote_first_token_due() and not step.reader.ready():
            self.sink.take_arrivals(FIRST_TOKEN_POLL_S)  # an arrived first token leaves now, not after the step
        tokens = step.reader.take()
        now = time.perf_counter()
        elapsed = now - max(step.started, self._tokens_at)  # from the later of its launch and the last tokens out
        self._tokens_at = now
        if step.marks is not None and self.trace is not None:
            self.trace.step_read(step.marks, read_s, now)
        self.steps += 1
        metrics.DECODE_STEP.observe(elapsed)
        for seq in step.release_after:
            self.admission.release(seq)
        live = {id(s) for s in running}
        logprobs = step.logprobs.read(len(tokens)) if step.logprobs is not None else [None] * len(tokens)
        return {id(seq) for seq, token, lp in zip(step.seqs, tokens, logprobs, strict=True)
                if id(seq) in live and self.sink.append(seq, token, elapsed, now, lp)}
