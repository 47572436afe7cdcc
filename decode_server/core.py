"""The decode server's request core: one request from acceptance to its end, whichever front end
took it (gRPC's `pd.v1.Decode` in service.py). A front end parses its wire format into a
`Request`, `accept`s it, iterates the `Generation`'s tokens, and `finish`es it with the status it
answered; nothing here knows the front end's call object.

A request's way: `accept` -> `Admission.reserve` (its KV blocks) -> for a remote prefill,
`PrefillRouter.prefill` (the prefill server's first token and KV) -> `BatchScheduler.submit`
(local prefill, decode steps; tokens out through the sequence's `RequestOutput`) ->
`Generation.run` -> `finish` (the request log). Its blocks go back in the scheduler, also when
the request ends before it got there (`BatchScheduler.let_go`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from pd.v1 import decode_pb2

from decode_server import metrics
from decode_server.config import DecodeConfig, PrefillMode
from decode_server.placement import LOCAL, REMOTE, PlacementInputs, place
from decode_server.prefill_client import PrefillFailed, PrefillRouter
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import Rejected, RequestSequence, TokenOutput
from decode_server.timing import Timing
from engine.grammar import CompiledGrammar
from engine.penalty_spec import Penalties
from engine.sampling import SamplingParams
from serving.gc_freeze import GcPauses
from serving.loop_lag import LoopLagProbe
from serving.token_ids import TokenIds

log = logging.getLogger(__name__)
request_log = logging.getLogger("decode_server.requests")


@dataclass(frozen=True)
class Request:
    """A request as a front end parsed and checked it."""

    request_id: str
    prompt: TokenIds
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    ignore_eos: bool
    mode: PrefillMode
    chunk_size: int
    arrival: float  # perf_counter when it came in
    prefill_sms: int = 0  # partitioned: its prefill's SM count; 0 = the server's
    cache_salt: str = ""  # its prefix-cache namespace, in both servers; "" = none
    logprobs: int | None = None  # log probabilities of its tokens and this many alternatives; None: none
    prompt_logprobs: int | None = None  # ... and of its prompt's tokens
    prompt_ranks: bool = False  # ... with each prompt token's rank among all tokens
    penalties: Penalties | None = None
    grammar: CompiledGrammar | None = None  # structured outputs: what its answer must follow


class Generation:
    """One accepted request. `run()` takes it through the server, yielding its tokens and raising
    Rejected with the status that ends it otherwise; `cancel()` may come from any thread (e.g. a
    call's done callback)."""

    def __init__(self, core: DecodeCore, seq: RequestSequence) -> None:
        self.core, self.seq = core, seq
        self.submitted = False  # the scheduler owns the sequence (and its blocks)

    def cancel(self) -> None:
        self.seq.cancelled.set()

    async def run(self) -> AsyncGenerator[TokenOutput, None]:
        """Reserve its KV blocks, place its prefill, hand it to the scheduler (after the remote
        prefill, where it was placed there), then stream its tokens."""
        seq, timing = self.seq, self.seq.timing
        await self._reserve()
        self.core.place(seq)
        await self._submit()
        last = timing.arrival
        while True:  # the tokens as the scheduler hands them out, timed for the metrics
            out = await seq.out.next()
            if isinstance(out, Rejected):
                raise out
            now = time.perf_counter()
            if out.index == 0:
                metrics.TTFT.observe(now - timing.arrival)
            else:
                metrics.ITL.observe(now - last)
            last = now
            yield out
            if out.finish_reason:
                metrics.E2E.observe(now - timing.arrival)
                metrics.REQUEST_SUCCESS.labels(out.finish_reason).inc()
                return

    async def _reserve(self) -> None:
        timing = self.seq.timing
        await self.core.admission.reserve(self.seq)
        timing.admitted = time.perf_counter()
        metrics.QUEUE_TIME.observe(timing.admitted - timing.arrival)

    async def _submit(self) -> None:
        core, seq = self.core, self.seq
        if seq.mode == PrefillMode.DISAGGREGATED:
            await core.scheduler.submit_after_remote_prefill(seq, core.remote_prefill(seq))
        else:
            core.scheduler.submit(seq)
        self.submitted = True


class DecodeCore:
    def __init__(self, cfg: DecodeConfig, scheduler: BatchScheduler, router: PrefillRouter | None,
                 eos_ids: frozenset[int], loop_lag: LoopLagProbe | None = None,
                 gc_pauses: GcPauses | None = None) -> None:
        self.cfg, self.scheduler, self.router, self.eos_ids = cfg, scheduler, router, eos_ids
        self.loop_lag, self.gc_pauses = loop_lag, gc_pauses  # for each request's loop_lag_max_s, gc_pause_max_s
        self.admission = scheduler.admission
        self.in_flight: set[str] = set()
        self.remote_prefills = 0  # requests in a remote prefill now
        self.remote_backlog_tokens = 0  # their uncached tokens
        self._holding: set[asyncio.Task[None]] = set()  # blocks of ended requests a transfer may still write
        self.draining = False

    def num_waiting(self) -> int:
        """Accepted, not yet decoding: waiting for KV, in remote prefill, or queued in the scheduler."""
        return self.admission.waiting + self.remote_prefills + self.scheduler.num_waiting

    def start_draining(self) -> None:
        """SIGTERM: new requests get UNAVAILABLE; those in flight carry on."""
        self.draining = True

    def check_open(self) -> None:
        """Raises Rejected (UNAVAILABLE) when this server takes no new requests."""
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the decode server is shutting down; retry on another replica")
        if self.scheduler.failed is not None:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the decode engine has failed; the server is exiting")

    def accept(self, request: Request) -> Generation:
        """Raises Rejected: INVALID_ARGUMENT for a remote prefill without a prefill server,
        ALREADY_EXISTS for a request_id in flight."""
        if request.mode == PrefillMode.DISAGGREGATED and self.router is None:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "disaggregated prefill needs a prefill server; this "
                                                             "decode server was started without --prefill-addr")
        if request.request_id in self.in_flight:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight")
        self.in_flight.add(request.request_id)
        seq = RequestSequence(request.request_id, request.prompt, request.max_new_tokens, request.sampling,
                       request.stop_ids, frozenset() if request.ignore_eos else self.eos_ids, request.mode,
                       request.chunk_size, timing=Timing(arrival=request.arrival), prefill_sms=request.prefill_sms,
                       cache_salt=request.cache_salt, logprobs=request.logprobs,
                       prompt_logprobs=request.prompt_logprobs, prompt_ranks=request.prompt_ranks,
                       penalties=request.penalties,
                       grammar=request.grammar)
        return Generation(self, seq)

    def finish(self, generation: Generation, status: str) -> None:
        """However the request ended (`status`: OK or the status code's name): the scheduler lets go
        of it, and it is counted and logged."""
        seq = generation.seq
        generation.cancel()
        if not generation.submitted and seq.block_table:
            self.scheduler.let_go(seq)
        self.in_flight.discard(seq.request_id)
        if status != "OK":
            metrics.REQUEST_FAILURE.labels(status).inc()
        now = time.perf_counter()
        lag: dict[str, float] = {}
        t = seq.timing
        if self.loop_lag is not None:  # while the request arrived: from its arrival to its first token
            lag["loop_lag_max_s"] = round(self.loop_lag.max_between(t.arrival, t.first_token or now), 6)
        if self.gc_pauses is not None:  # the collector's share of that lag, if any
            lag["gc_pause_max_s"] = round(self.gc_pauses.max_between(t.arrival, t.first_token or now), 6)
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": seq.request_id, "status": status,
            "finish_reason": seq.finish_reason, "mode": seq.mode, "prompt_tokens": len(seq.prompt),
            "output_tokens": len(seq.tokens), **seq.timing.to_log(now), **lag}))

    @staticmethod
    def log_rejected(request_id: str, code: grpc.StatusCode, arrival: float) -> None:
        """A request refused before it was accepted: counted and logged like any other ending."""
        metrics.REQUEST_FAILURE.labels(code.name).inc()
        request_log.info(json.dumps({
            "event": "request_finished", "request_id": request_id, "status": code.name, "finish_reason": "",
            "mode": None, "prompt_tokens": None, "output_tokens": 0,
            **Timing(arrival=arrival).to_log(time.perf_counter())}))

    def place(self, seq: RequestSequence) -> None:
        """Where the admitted sequence's prefill runs: mode auto picks here (--auto-local-mode) or a
        prefill server from its uncached tokens, who decodes here, and the remote prefills in flight."""
        if seq.mode == PrefillMode.AUTO:
            # our own remote prefills in flight, or what the prefill servers last said they hold (other decode
            # servers' prompts too), whichever is more
            backlog = max(self.remote_backlog_tokens, self.router.reported_backlog_tokens() if self.router else 0)
            inputs = PlacementInputs(len(seq.prompt) - seq.prefilled, len(self.scheduler.running), backlog,
                                     self.router is not None)
            remote = place(self.cfg.placement_thresholds, inputs) == REMOTE
            seq.mode = PrefillMode.DISAGGREGATED if remote else PrefillMode(self.cfg.auto_local_mode)
        seq.timing.placement = REMOTE if seq.mode == PrefillMode.DISAGGREGATED else LOCAL

    def _hold_blocks(self, seq: RequestSequence, failure: PrefillFailed) -> None:
        """The sequence ends without its blocks, which a transfer may still write; they go back (through
        the scheduler, as any ended sequence's) once the handoff proves it can't any more, if ever."""
        held, seq.block_table = seq.block_table, []
        settled_late = failure.settled_late

        async def free_when_settled() -> None:
            if settled_late is not None and await settled_late:
                seq.block_table = held
                self.scheduler.let_go(seq)
            else:
                log.error("request %s: %d KV blocks stay reserved for good", seq.request_id, len(held))

        task = asyncio.get_running_loop().create_task(free_when_settled())
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)

    async def remote_prefill(self, seq: RequestSequence) -> int:
        """Prefill on a prefill server; its KV lands in this request's blocks. Returns the first token.

        A failure that a second try may cure is retried once, with the same blocks: after
        UNAVAILABLE or FAILED_PRECONDITION the router has dropped the pairing, so the retry
        handshakes afresh; after UNAVAILABLE it has also taken that prefill server out of the
        rotation (a frozen one is found by its silence in seconds), so the retry goes to another.
        That covers a prefill server that restarted while this one was idle: it answers the stale
        pairing with "handshake first". A server that is down, or a real layout mismatch, fails the
        retry the same way at once."""
        assert self.router is not None  # accept() refuses the mode without one
        p = seq.params
        sampling = decode_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)
        uncached = len(seq.prompt) - seq.prefilled
        self.remote_prefills += 1
        self.remote_backlog_tokens += uncached
        try:
            for attempt in range(2):
                try:
                    first_token = await self.router.prefill(seq.request_id, seq.prompt, sampling, seq.block_table,
                                                            seq.prefilled, seq.timing, seq.cache_salt)
                    break
                except PrefillFailed as e:
                    if not e.blocks_free:  # a transfer may still land in them: not reused until it can't
                        self._hold_blocks(seq, e)
                    retry = (attempt == 0 and e.blocks_free
                             and e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION))
                    if not retry:
                        raise Rejected(e.code, str(e)) from e
                    log.info("request %s: %s; retrying once with a fresh handshake", seq.request_id, e)
        finally:
            self.remote_prefills -= 1
            self.remote_backlog_tokens -= uncached
        t = seq.timing
        metrics.PREFILL_SECONDS.observe(t.prefill_s)
        metrics.KV_TRANSFER_SECONDS.observe(t.kv_transfer_s)
        metrics.KV_TRANSFER_BYTES.labels(t.kv_transport).inc(t.kv_bytes)
        return first_token
