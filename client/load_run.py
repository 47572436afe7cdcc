"""Sends a plan to one deployment: Poisson arrivals plus back-to-back background users, round-robin over targets."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from pd.v1 import decode_pb2, decode_pb2_grpc
from tqdm import tqdm

from client.load_plan import BackgroundUser, LoadPlan, RequestSpec
from client.openai_stream import base_url, collect_openai, completion_body
from client.stream import PREFILL_MODES, StreamResult, collect, open_channel

MODES = tuple(PREFILL_MODES)
APIS = ("grpc", "openai")  # pd.v1.Decode, or the OpenAI HTTP API's /v1/completions
MODE_ENUM: dict[str | None, int] = {None: decode_pb2.PREFILL_MODE_UNSPECIFIED, **PREFILL_MODES}
# the ServerTiming fields each request records, with how the load report names them
SERVER_TIMING = {"queue_s": "Queue (KV blocks, batch slot)", "prefill_queue_s": "Prefill server's queue",
                 "prefill_s": "Prefill compute", "kv_transfer_s": "KV handoff beyond the prefill",
                 "first_token_s": "Received to first token"}


@dataclass(frozen=True)
class Deployment:
    """Where a run goes: decode servers behind client-side round-robin, and the per-request mode override."""

    name: str
    targets: tuple[str, ...]
    mode: str | None = None     # None: each server's own --mode
    chunk_size: int = 0         # 0: the server's --chunk-size
    prefill_sms: int = 0        # partitioned: 0 = the server's --prefill-sms
    api: str = "grpc"           # one of APIS; openai targets are HTTP URLs or host:port (/v1 added)
    extra_body: str = ""        # openai: a JSON object merged into every request (logprobs, penalties, ...)

    def describe(self) -> str:
        mode = self.mode or "server default"
        if self.mode == "chunked" and self.chunk_size:
            mode += f":{self.chunk_size}"
        if self.mode == "partitioned" and self.prefill_sms:
            mode += f":{self.prefill_sms}"
        return f"{','.join(self.targets)} @ {mode} over {self.api}"


@dataclass
class Record:
    """What happened to one request; times are seconds from the run's start."""

    key: str
    kind: str
    target: str
    prompt_len: int
    max_new_tokens: int
    long: bool
    sent_s: float
    token_times_s: list[float] = field(default_factory=list)
    status: str = "OK"          # "OK", a gRPC status code name, or a client-side exception's name
    error_message: str = ""
    server: dict[str, float] = field(default_factory=dict)
    turn: int = 1               # its place in a conversation (--turns)
    cached_tokens: int = 0      # prompt tokens whose KV came from a server's prefix cache
    placement: str = ""         # where the server ran the prefill: "local" or "remote" (empty: not said)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s

    @property
    def gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a one-token answer."""
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None


@dataclass
class RunResult:
    deployment: Deployment
    records: list[Record]
    duration_s: float


def make_record(spec: RequestSpec, target: str, result: StreamResult, t0: float) -> Record:
    record = Record(spec.key, spec.kind, target, len(spec.token_ids), spec.output_len, spec.long,
                    result.sent_at - t0, [a - t0 for a in result.arrivals], turn=spec.turn)
    if result.error is not None:
        record.status, record.error_message = result.error.name, result.error_message
    elif not result.finish_reason:  # the stream closed without its last message: the server broke its contract
        record.status, record.error_message = "INCOMPLETE", f"stream ended after {len(result.tokens)} tokens"
    if result.last is not None:
        timing = result.last.timing
        record.server = {name: getattr(timing, name) for name in SERVER_TIMING}
        record.cached_tokens, record.placement = timing.cached_tokens, timing.placement
    return record


class LoadRunner:
    """One run of a plan against one deployment. Failures become records; nothing here raises per request."""

    def __init__(self, plan: LoadPlan, deployment: Deployment, timeout_s: float, tls_ca: str | None = None,
                 progress: bool = True) -> None:
        self.plan, self.deployment, self.timeout_s, self.tls_ca = plan, deployment, timeout_s, tls_ca
        self.progress = progress
        self.run_id = f"load-{uuid.uuid4().hex[:8]}"  # unique per run, so two runs never collide on request_id
        self.records: list[Record] = []
        self._prebuilt: dict[str, decode_pb2.GenerateRequest | bytes] = {}
        self.t0 = 0.0
        self.openai = deployment.api == "openai"
        self._session: aiohttp.ClientSession | None = None
        self._urls = [base_url(t) for t in deployment.targets]

    def _request(self, spec: RequestSpec) -> decode_pb2.GenerateRequest | bytes:
        return self._build(f"{self.run_id}-{spec.key}", spec.token_ids.tolist(), spec.output_len)

    def _build(self, request_id: str, token_ids: list[int], max_new_tokens: int) -> decode_pb2.GenerateRequest | bytes:
        """The request as the deployment's API takes it (an OpenAI body: JSON bytes)."""
        d = self.deployment
        if self.openai:
            return completion_body(token_ids, max_new_tokens, d.mode, d.chunk_size, d.prefill_sms, d.extra_body)
        return decode_pb2.GenerateRequest(
            request_id=request_id, token_ids=token_ids, max_new_tokens=max_new_tokens,
            ignore_eos=True,  # output lengths are as planned
            prefill_mode=MODE_ENUM[d.mode], chunk_size=d.chunk_size, prefill_sms=d.prefill_sms)

    async def _collect(self, index: int, request: decode_pb2.GenerateRequest | bytes, request_id: str) -> StreamResult:
        if isinstance(request, bytes):
            assert self._session is not None
            return await collect_openai(self._session, self._urls[index], request, request_id, self.timeout_s)
        return await collect(self._stubs[index], request, self.timeout_s)

    async def _send(self, spec: RequestSpec, index: int | None = None) -> tuple[Record, list[int]]:
        """One request, to the target at `index` (default: the next in turn); its record and the tokens it got."""
        index = next(self._next_target) if index is None else index
        target = self.deployment.targets[index]
        sent = time.perf_counter()
        request = self._prebuilt.pop(spec.key, None)
        if request is None:  # background users' requests depend on how many they get to send
            request = self._request(spec)
        tokens: list[int] = []
        try:
            result = await self._collect(index, request, f"{self.run_id}-{spec.key}")
            record, tokens = make_record(spec, target, result, self.t0), result.tokens
        except Exception as e:  # a client-side fault in one request must not end the run
            record = Record(spec.key, spec.kind, target, len(spec.token_ids), spec.output_len, spec.long,
                            sent - self.t0, status=type(e).__name__, error_message=str(e), turn=spec.turn)
        self.records.append(record)
        self._count(record)
        return record, tokens

    async def _conversation(self, spec: RequestSpec) -> None:
        """An arrival, then its later turns, each sent once the previous answer is complete; a failed
        turn ends the conversation. Its turns stay on one target (session affinity), where its history's
        KV may still be cached."""
        turn: RequestSpec | None = spec
        index = next(self._next_target)
        while turn is not None:
            record, answer = await self._send(turn, index)
            turn = turn.follow_up(answer, time.perf_counter() - self.t0) if record.ok else None

    def _count(self, record: Record) -> None:
        if record.kind == "arrival":
            self._bar.update(1)
        elif record.kind == "turn":
            self._turns_done += 1
        else:
            self._background_done += 1
        self._failed += not record.ok
        self._bar.set_postfix(background=self._background_done, turns=self._turns_done, failed=self._failed,
                              refresh=False)

    async def _arrivals(self) -> None:
        tasks: list[asyncio.Task[None]] = []
        for spec in self.plan.arrivals:
            await asyncio.sleep(max(0.0, self.t0 + spec.at - time.perf_counter()))
            tasks.append(asyncio.create_task(self._conversation(spec)))
        await asyncio.gather(*tasks)

    async def _background(self, user: BackgroundUser, deadline: float) -> None:
        while time.perf_counter() < deadline:
            await self._send(user.next())

    async def _warmup(self) -> None:
        """One short request per server before the clock starts, so first-call costs are not measured."""
        for index, target in enumerate(self.deployment.targets):
            request_id = f"{self.run_id}-warmup{index}"
            result = await self._collect(index, self._build(request_id, list(range(16)), 2), request_id)
            if result.error is not None:
                print(f"warning: warm-up request to {target} failed: {result.error.name}: {result.error_message}",
                      file=sys.stderr)

    async def run(self, warmup: bool = True) -> RunResult:
        channels = [] if self.openai else [open_channel(target, self.tls_ca) for target in self.deployment.targets]
        self._stubs = [decode_pb2_grpc.DecodeStub(channel) for channel in channels]
        if self.openai:  # no connection limit: every user streams at once, as over gRPC's one channel
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._next_target = itertools.cycle(range(len(self.deployment.targets)))
        self._background_done = self._turns_done = self._failed = 0
        self._bar = tqdm(total=len(self.plan.arrivals), desc=self.deployment.name, unit="req", file=sys.stderr,
                         disable=not self.progress, dynamic_ncols=True)
        try:
            if warmup:
                await self._warmup()
            # built before the clock starts: a 32k-token request costs the event loop ~1.5 ms, which would
            # otherwise show up as a gap in whichever streams are being read at that moment
            self._prebuilt = {spec.key: self._request(spec) for spec in self.plan.arrivals}
            self.t0 = time.perf_counter()
            deadline = self.t0 + self.plan.spec.duration
            await asyncio.gather(self._arrivals(), *(self._background(u, deadline) for u in self.plan.users))
            duration = time.perf_counter() - self.t0
        finally:
            self._bar.close()
            await asyncio.gather(*(channel.close() for channel in channels))
            if self._session is not None:
                await self._session.close()
        self.records.sort(key=lambda r: r.sent_s)
        return RunResult(self.deployment, self.records, duration)
