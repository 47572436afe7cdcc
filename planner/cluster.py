"""Discrete-event simulation of N prefill x M decode servers, each the loop the real servers run.

A decode server's iteration is the engine thread's `step()`: admit ready sequences into the running
batch (continuous batching, up to --max-batch-size), run at most one local prefill piece (a whole
prompt, one chunk, or one slice of layers), then one decode step for every running sequence. In
`partitioned` mode the local prefill runs beside the decode steps on a share of the SMs instead,
slowing both. A prefill server runs one prompt at a time and hands the KV over; the request joins
its decode server's batch once the handoff is done. Each engine keeps a prefix cache of the
conversations it prefilled, so a later turn prefills only the tokens it has not seen.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_server.placement import REMOTE, PlacementInputs, PlacementThresholds, place
from planner.costs import KV_BYTES_PER_TOKEN, Costs, layered_slices
from planner.deployment import Deployment, Serving
from planner.network import Network, node_layout
from planner.traffic import SimRequest, Traffic


class Clock:
    """The event queue: callbacks run in time order, ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()


def cached_of(cache: dict[str, int], request: SimRequest) -> int:
    """The leading tokens of `request` an engine whose cache is `cache` holds: its conversation's history."""
    return min(request.history, cache.get(request.conversation or "", 0))


class PrefillServer:
    """One prompt at a time, first come first served; the KV streams out layer by layer as it computes, and the
    next prompt starts once the last layer's sends are done (the decode side's completion of the handoff
    overlaps it)."""

    def __init__(self, clock: Clock, costs: Costs, serving: Serving, prefix_cache: bool = True, node: int = 0,
                 network: Network | None = None) -> None:
        self.clock, self.costs, self.serving, self.prefix_cache = clock, costs, serving, prefix_cache
        self.node, self.network = node, network or Network()
        # (request, its decode server's callback, uncached tokens, the decode server's node and cached tokens)
        self.queue: deque[tuple[SimRequest, Callable[[], None], int, int, int]] = deque()
        self.busy_until = 0.0
        self.cache: dict[str, int] = {}
        self.backlog_tokens = 0  # uncached tokens waiting or running, as the server reports them (mode auto)

    @property
    def backlog(self) -> int:
        return len(self.queue) + (self.busy_until > self.clock.now)

    def submit(self, request: SimRequest, on_kv: Callable[[], None], decode_node: int = 0,
               decode_cached: int = 0) -> None:
        uncached = request.prompt - cached_of(self.cache, request)
        self.backlog_tokens += uncached
        self.queue.append((request, on_kv, uncached, decode_node, decode_cached))
        if self.busy_until <= self.clock.now and len(self.queue) == 1:
            self._start()

    def _start(self) -> None:
        request, on_kv, uncached, decode_node, decode_cached = self.queue.popleft()
        request.cached = cached_of(self.cache, request)
        compute_ms = self.costs.prefill_ms(request.prompt - request.cached, request.cached)
        request.prefill_s = (compute_ms + self.serving.remote_prefill_ms) / 1e3
        end = self.clock.now + request.prefill_s
        if request.conversation is not None and self.prefix_cache:
            self.cache[request.conversation] = request.prompt
        # the worker waits for its last sends before taking the next prompt (prefill_server.worker: sender.finish());
        # the rest of the handoff (the decode side's receive completing, the result message) overlaps the next
        # prompt's compute
        handoff_ms = self.costs.kv_handoff_ms(request.prompt)
        hold_ms = self.costs.prefill_server_hold_ms(request.prompt)
        if decode_node != self.node:  # across the NICs: what the decode server lacks, streamed as layers finish
            sent = request.prompt - decode_cached
            handoff_ms = self.network.handoff_ms(self.costs, request.prompt, sent, compute_ms)
            hold_ms = self.network.hold_ms(self.costs, request.prompt, sent, compute_ms)
        self.busy_until = end + hold_ms / 1e3
        self.clock.at(end + handoff_ms / 1e3, on_kv)
        self.clock.at(self.busy_until, lambda: self._finished(uncached))

    def _finished(self, uncached: int) -> None:
        """The job has run: it leaves the backlog the server reports (the worker's `_finished`); the next starts."""
        self.backlog_tokens -= uncached
        self._next()

    def _next(self) -> None:
        if self.queue:
            self._start()


@dataclass
class _LocalPrefill:
    request: SimRequest
    mode: str
    done_tokens: int = 0
    slices_left: int = 0


@dataclass
class DecodeServer:
    """The decode server's engine loop, with the local prefill modes."""

    index: int
    clock: Clock
    costs: Costs
    deployment: Deployment
    serving: Serving
    prefill_servers: list[PrefillServer]
    on_done: Callable[[SimRequest], None]
    prefilling: deque[_LocalPrefill] = field(default_factory=deque)
    ready: deque[SimRequest] = field(default_factory=deque)
    running: int = 0
    context: int = 0
    reserved: int = 0
    step: int = 0
    step_ends: list[float] = field(default_factory=list)
    finishing: dict[int, list[SimRequest]] = field(default_factory=lambda: defaultdict(list))
    cache: dict[str, int] = field(default_factory=dict)
    busy: bool = False
    partition_until: float = 0.0
    remote_backlog_tokens: int = 0  # uncached tokens of this server's remote prefills whose KV has not landed (auto)
    inbox: deque[SimRequest] = field(default_factory=deque)  # prompts prefilled elsewhere, for the next iteration
    # running sequences by context less the step they joined at (the longest is on top; finished ones are
    # dropped when they reach the top): the attention's cost follows the longest context
    by_context: list[tuple[int, int, SimRequest]] = field(default_factory=list)
    node: int = 0

    def __post_init__(self) -> None:
        self.capacity = int(self.deployment.kv_cache_gb * 1e9 // KV_BYTES_PER_TOKEN)
        self.slowdown, self.partition_rate = self.costs.partition_factors(self.deployment.partition_sms)

    # --- placement ---------------------------------------------------------------------------------
    def submit(self, request: SimRequest) -> None:
        request.server = self.index
        mode = self._placement(request)
        if mode == "disaggregated":
            request.where = "remote"
            uncached = request.prompt - cached_of(self.cache, request)
            self.remote_backlog_tokens += uncached  # decode_server.core.remote_prefill: its tokens in flight
            target = min(self.prefill_servers, key=lambda p: p.backlog)
            target.submit(request, lambda: self._kv_arrived(request, uncached), self.node,
                          request.prompt - uncached)
            return
        request.where = "local"
        self.prefilling.append(_LocalPrefill(request, mode))
        self._wake()

    def _placement(self, request: SimRequest) -> str:
        d = self.deployment
        if d.mode != "auto":
            return d.mode
        uncached = request.prompt - cached_of(self.cache, request)
        thresholds = PlacementThresholds(d.auto_local_tokens, d.auto_idle_local_tokens, d.auto_remote_backlog_tokens)
        # decode_server.core.place: this server's own remote prefills in flight (until their KV has landed) or the
        # smallest backlog a prefill server reports, whichever is more
        backlog = max(self.remote_backlog_tokens, min(p.backlog_tokens for p in self.prefill_servers))
        where = place(thresholds, PlacementInputs(uncached, self.running, backlog, True))
        return "disaggregated" if where == REMOTE else d.auto_local

    def _kv_arrived(self, request: SimRequest, uncached: int = 0) -> None:
        self.remote_backlog_tokens -= uncached
        self._post_to_inbox(request)

    def _post_to_inbox(self, request: SimRequest) -> None:
        """A prompt prefilled off the engine thread (a prefill server's KV landed, or a partitioned prefill is
        done) reaches the engine thread through its inbox, which it reads when an iteration begins: its first
        token goes out then, after whatever prefill piece and decode step were under way."""
        self.inbox.append(request)
        self._wake()

    def _take_inbox(self) -> None:
        now = self.clock.now
        while self.inbox:
            request = self.inbox.popleft()
            request.first_token = now
            self._ready(request)

    def _ready(self, request: SimRequest) -> None:
        if request.output <= 1:
            request.done = request.first_token
            self.on_done(request)
            return
        self.ready.append(request)
        self._wake()

    # --- the engine loop ---------------------------------------------------------------------------
    def _wake(self) -> None:
        if not self.busy:
            self.busy = True
            self.clock.at(self.clock.now, self._iteration)

    def _admit(self) -> float:
        """Ready sequences into the running batch; returns the milliseconds their admission adds to this step."""
        added = 0.0
        while self.ready and self.running < self.deployment.max_batch:
            request = self.ready[0]
            need = request.prompt + request.output
            if self.running and self.reserved + need > self.capacity:
                break  # the KV pool is full: it waits for a running sequence to finish
            self.ready.popleft()
            self.reserved += need
            request.join_step = self.step
            self.running += 1
            self.context += request.prompt + 1
            heapq.heappush(self.by_context, (self.step - request.prompt - 1, id(request), request))
            self.finishing[self.step + request.output - 2].append(request)
            added += self.serving.join_remote_ms if request.where == "remote" else self.serving.join_local_ms
        return added

    def _iteration(self) -> None:
        now = self.clock.now
        self._take_inbox()
        admitted = self._admit()
        t = now + self._prefill_piece(now)
        stepped = self.running > 0
        if stepped:
            slowdown = self.slowdown if self.partition_until > now else 1.0
            step_ms = self.costs.decode_ms(self.running, self.context, self._longest(), slowdown)
            host_ms = self.serving.step_host_ms_per_seq * self.running + admitted
            t += (step_ms + host_ms) / 1e3
        if t == now:
            self.busy = False  # idle until a request arrives or a prefill/handoff ends
            return
        # the next iteration is scheduled before the step's finished requests are reported at t: the engine
        # thread goes straight on, and what a client sends in answer to a last token finds it under way
        self.clock.at(t, self._iteration)
        if stepped:
            self._end_step(t)

    def _longest(self) -> int:
        """The longest running sequence's context at this step."""
        while self.by_context[0][2].finished:
            heapq.heappop(self.by_context)
        return self.step - self.by_context[0][0]

    def _end_step(self, t: float) -> None:
        self.step_ends.append(t)
        self.context += self.running
        for request in self.finishing.pop(self.step, ()):
            request.done = t
            self.running -= 1
            self.reserved -= request.prompt + request.output
            self.context -= request.prompt + request.output
            if request.conversation is not None and self.deployment.prefix_cache:  # however it was prefilled
                self.cache[request.conversation] = request.prompt + request.output
            self.clock.at(t, lambda r=request: self.on_done(r))  # type: ignore[misc]  # when its last token is out
        self.step += 1

    def _prefill_piece(self, now: float) -> float:
        """Seconds the head of the local prefill queue takes this iteration (0 in partitioned mode: it runs beside)."""
        if not self.prefilling:
            return 0.0
        head = self.prefilling[0]
        request = head.request
        if head.done_tokens == 0 and head.slices_left == 0:
            request.cached = cached_of(self.cache, request)
            head.done_tokens = request.cached
        new = request.prompt - request.cached
        if head.mode == "partitioned":
            self._to_partition(now)
            return 0.0
        if head.mode == "chunked":
            size = min(self.deployment.chunk_size, request.prompt - head.done_tokens)
            ms = self.costs.chunk_piece_ms(size, head.done_tokens, request.cached) + self.serving.local_call_ms
            head.done_tokens += size
            finished = head.done_tokens >= request.prompt
        elif head.mode == "layered":
            slices = layered_slices(new, self.deployment.layer_slice_tokens)
            if head.slices_left == 0:
                head.slices_left = slices
            head.slices_left -= 1
            finished = head.slices_left == 0
            ms = self.costs.layer_slice_ms(new, request.cached, slices) + self.serving.local_call_ms
        else:
            ms = self._local_ms(new, request.cached)
            finished = True
        request.prefill_s += ms / 1e3
        if finished:
            self.prefilling.popleft()
            self.clock.at(now + ms / 1e3, lambda: self._first_token(request))
        return ms / 1e3

    def _to_partition(self, now: float) -> None:
        """Partitioned mode: the engine thread hands every waiting prompt to the prefill thread, which runs one
        at a time on its share of the SMs, each as soon as the one before it is done."""
        while self.prefilling:
            request = self.prefilling.popleft().request
            request.cached = cached_of(self.cache, request)
            new, rate = request.prompt - request.cached, self.partition_rate
            # the server's factor over the engine's prefill, and its call's own costs on the share; a later turn's
            # floor not slowed by it (Costs.prefill_on_share_ms)
            on_share = self.costs.local_prefill_on_share_ms(new, request.cached, rate)
            seconds = (on_share + self.serving.local_call_ms / rate) / 1e3
            request.prefill_s = seconds
            self.partition_until = max(now, self.partition_until) + seconds
            self.clock.at(self.partition_until, lambda r=request: self._post_to_inbox(r))  # type: ignore[misc]

    def _local_ms(self, new: int, cached: int) -> float:
        return self.costs.local_prefill_ms(new, cached) + self.serving.local_call_ms

    def _first_token(self, request: SimRequest) -> None:
        request.first_token = self.clock.now
        self._ready(request)


class Cluster:
    """Clients round-robin over the decode servers in the order they send, as `client.load` does."""

    def __init__(self, deployment: Deployment, costs: Costs, traffic: Traffic, serving: Serving | None = None,
                 network: Network | None = None) -> None:
        self.deployment, self.traffic = deployment, traffic
        self.clock = Clock()
        serving, network = serving or Serving(), network or Network()
        prefill_nodes, decode_nodes = node_layout(deployment.pools, deployment.prefill, deployment.decode,
                                                  network.gpus_per_node)
        self.prefill = [PrefillServer(self.clock, costs, serving, deployment.prefix_cache, node, network)
                        for node in prefill_nodes]
        # per-node pools: a decode server's prompts go to its own node's prefill servers only
        self.decode = [DecodeServer(i, self.clock, costs, deployment, serving,
                                    [p for p in self.prefill if deployment.pools != "per-node" or p.node == node],
                                    self._done, node=node)
                       for i, node in enumerate(decode_nodes)]
        self.requests: list[SimRequest] = []
        self._next_target = itertools.cycle(range(deployment.decode))
        self._affinity: dict[str, int] = {}

    def run(self) -> list[SimRequest]:
        for request in self.traffic.initial():
            self.clock.at(request.sent, lambda r=request: self._send(r))  # type: ignore[misc]
        for user in range(len(self.traffic.users)):
            self.clock.at(0.0, lambda u=user: self._send(self.traffic.background(u, 0.0)))  # type: ignore[misc]
        self.clock.run()
        return self.requests

    def _send(self, request: SimRequest) -> None:
        self.requests.append(request)
        if request.conversation is not None and request.conversation in self._affinity:
            server = self._affinity[request.conversation]  # a conversation's turns go where its history is
        else:
            server = next(self._next_target)
            if request.conversation is not None:
                self._affinity[request.conversation] = server
        self.decode[server].submit(request)

    def _done(self, request: SimRequest) -> None:
        now, duration = self.clock.now, self.traffic.spec.duration
        if request.user is not None and now < duration:
            self._send(self.traffic.background(request.user, now))
        elif (turn := self.traffic.next_turn(request)) is not None and (
                turn.sent < duration or self.traffic.conversations.finish):
            self.clock.at(turn.sent, lambda: self._send(turn))
