"""The decode server's side of the pair: find prefill servers, handshake with them, run remote
prefills, and get the KV that comes back into this server's pool (each transport's side of it is
in decode_server.kv_receive)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from pd.v1 import decode_pb2, prefill_pb2, prefill_pb2_grpc

from decode_server.kv_receive import Handoff, HandoffError, Pairing, PeerLink
from decode_server.pairings import PAIRINGS
from decode_server.peer_watch import PROBE_EVERY_S, PeerHealth, Silent, until_silent
from decode_server.timing import Timing
from engine.runner import ModelRunner
from engine.transport.base import KVTransport
from engine.transport.grpc_wire import KVView, prefill_stream
from engine.transport.handshake import (
    choose_transport,
    layout_from_proto,
    layout_mismatch_message,
    layout_to_proto,
    supported_transports,
)
from serving.grpc_common import GRPC_OPTIONS, StatusError
from serving.kv_release import KV_LEASE_S
from serving.token_ids import TokenIds

log = logging.getLogger(__name__)

DNS_REFRESH_S = 10.0
HANDSHAKE_TIMEOUT_S = 3.0  # a tiny RPC: a peer that can't answer it in time is as good as down
REJOIN_WAIT_S = 2 * PROBE_EVERY_S  # with no prefill server in the rotation, how long a request waits for one
RELEASE_TIMEOUT_S = 1.0    # a Release's wait for an answer, and the pause before it is sent again
BACKLOG_FRESH_S = 2.0      # a prefill server's backlog report older than this is not used (mode auto)


class PrefillFailed(StatusError):
    """A remote prefill failed; the request is answered with `code`. `blocks_free` is False when a
    transfer may still land in the request's blocks: they must stay out of circulation until
    `settled_late` (awaited) says True."""

    def __init__(self, code: grpc.StatusCode, message: str, blocks_free: bool = True,
                 settled_late: Coroutine[None, None, bool] | None = None) -> None:
        super().__init__(code, message)
        self.blocks_free = blocks_free
        self.settled_late = settled_late  # when not free: True once they may be freed after all


class PrefillPeer:
    """One prefill server: a channel, and the pairing made at the handshake (redone after a failure)."""

    def __init__(self, address: str, runner: ModelRunner, requested_transport: str,
                 credentials: grpc.ChannelCredentials | None, server_name: str | None = None) -> None:
        self.address = address
        self.runner = runner
        self.requested_transport = requested_transport
        self.credentials = credentials
        # dialled by IP (a dns:/// target's addresses), a TLS certificate is checked against the name resolved
        self.options = [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", server_name)] if server_name else GRPC_OPTIONS
        self.channel = (grpc.aio.secure_channel(address, credentials, options=self.options) if credentials
                        else grpc.aio.insecure_channel(address, options=self.options))
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)
        self.prefill_call = prefill_stream(self.channel)  # KV chunks arrive as views, not copies
        self.pairing: Pairing | None = None
        self.health = PeerHealth(address, self.channel)
        self.in_flight = 0
        self.reported_backlog_tokens = 0  # the server's own figure, every decode server's prompts together
        self.reported_at = -1e9           # time.monotonic() of that report
        self.peer_id = uuid.uuid4().hex[:12]
        self._handshake_lock = asyncio.Lock()

    def report_backlog(self, tokens: int) -> None:
        self.reported_backlog_tokens, self.reported_at = tokens, time.monotonic()

    def backlog_tokens(self) -> int:
        """Its last reported backlog, if recent (reports come with our own prefills: none lately, none known)."""
        return self.reported_backlog_tokens if time.monotonic() - self.reported_at <= BACKLOG_FRESH_S else 0

    async def ensure_paired(self, timeout: float, writer: ThreadPoolExecutor) -> Pairing:
        async with self._handshake_lock:
            if self.pairing is not None and not self.pairing.broken:
                return self.pairing
            self.forget_pairing()
            ours = supported_transports(self.runner.device, self.requested_transport)
            offer = ours if self.requested_transport == "auto" else [self.requested_transport]
            gpu = self.runner.device.index if self.runner.device.type == "cuda" else -1
            request = prefill_pb2.HandshakeRequest(layout=layout_to_proto(self.runner.layout), transports=offer,
                                                   peer_id=self.peer_id, host=socket.gethostname(),
                                                   gpu_index=gpu if gpu is not None else 0, pid=os.getpid())
            for transport in offer:  # what each transport offered must bring (nixl: its agent, made once)
                try:
                    request.MergeFrom(await asyncio.get_running_loop().run_in_executor(
                        writer, PAIRINGS[KVTransport(transport)].offer, self.runner.pool))
                except Exception as e:
                    raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"can't offer KV transport {transport}: {e}") \
                        from e
            try:
                reply = await self.stub.Handshake(request, timeout=min(timeout, HANDSHAKE_TIMEOUT_S))
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.health.down(f"handshake: {e.code().name}")
                raise peer_error(self.address, e, "handshake") from e
            problem = layout_mismatch_message(self.runner.layout, layout_from_proto(reply.layout))
            if problem:
                raise PrefillFailed(grpc.StatusCode.FAILED_PRECONDITION, f"prefill server {self.address}: {problem}")
            chosen = choose_transport(self.requested_transport, ours, [reply.transport])
            if chosen is None:
                raise PrefillFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill server {self.address} chose KV transport {reply.transport!r}, "
                                    f"which this decode server does not run")
            try:
                self.pairing = await asyncio.get_running_loop().run_in_executor(
                    writer, PAIRINGS[chosen].connect, reply, self.runner.layout, self.runner.device, timeout,
                    PeerLink(self.peer_id, self._blocking_channel))
            except Exception as e:
                raise PrefillFailed(grpc.StatusCode.UNAVAILABLE,
                                    f"prefill server {self.address}: setting up {chosen} failed: {e}") from e
            log.info("paired with prefill server %s (%s) over %s", self.address, reply.server_id, chosen)
            return self.pairing

    def _blocking_channel(self) -> grpc.Channel:
        """A blocking channel to this prefill server, like the handshake's (its caller closes it)."""
        return (grpc.secure_channel(self.address, self.credentials, options=self.options) if self.credentials
                else grpc.insecure_channel(self.address, options=self.options))

    def forget_pairing(self) -> None:
        if self.pairing is not None:
            self.pairing.forget()
        self.pairing = None


def peer_error(address: str, e: grpc.aio.AioRpcError, what: str) -> PrefillFailed:
    code = e.code()
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION):  # a KV layout mismatch stays one
        return PrefillFailed(code, f"prefill server {address}: {e.details()}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"prefill server {address} did not finish the {what} in time")
    return PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"prefill server {address} failed during the {what} "
                                                      f"({code.name}: {e.details()})")


class PrefillRouter:
    """Spreads remote prefills over the prefill servers (fewest in flight first). `targets` are
    host:port addresses or dns:///name:port, re-resolved as prefill pods come and go."""

    def __init__(self, targets: list[str], runner: ModelRunner, transport: str, timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None, verify_kv: bool = False) -> None:
        if not targets:
            raise ValueError("no prefill server address given")
        self.runner, self.transport, self.timeout_s, self.credentials = runner, transport, timeout_s, credentials
        self.verify_kv = verify_kv  # checksum every handoff on both sides
        self.targets = targets
        self.peers: dict[str, PrefillPeer] = {}
        self._resolved_at = -1e9
        self._rr = itertools.count()
        # One writer thread: KV writes never run on the event loop, and a barrier on this executor
        # proves every write of a request has landed before its blocks can be freed.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-writer",
                                         initializer=runner.bind_thread)
        self._releases: set[asyncio.Task[None]] = set()

    async def _refresh(self) -> None:
        if time.monotonic() - self._resolved_at < DNS_REFRESH_S and self.peers:
            return
        self._resolved_at = time.monotonic()
        addresses: dict[str, str | None] = {}  # address -> the DNS name it was resolved from
        for target in self.targets:
            if target.startswith("dns:///"):
                host, _, port = target.removeprefix("dns:///").rpartition(":")
                try:
                    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
                    addresses.update((f"{i[4][0]}:{port}", host) for i in sorted(infos, key=lambda i: i[4][0]))
                except OSError as e:
                    log.warning("can't resolve %s: %s", target, e)
            else:
                addresses[target] = None
        for address, name in addresses.items():
            if address not in self.peers:
                self.peers[address] = PrefillPeer(address, self.runner, self.transport, self.credentials, name)
        for address in [a for a, p in self.peers.items() if a not in addresses and not p.in_flight]:
            gone = self.peers.pop(address)
            gone.health.close()
            await gone.channel.close()

    async def warm_up(self) -> None:
        """Before serving: the KV writer thread started and bound to the device, and every prefill
        server paired (the handshake; NCCL's group and its warm-up; the IPC mapping of its pool),
        so the first remote prefill pays none of it. One not up yet is paired on first use."""
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self.writer, lambda: None)
        await self._refresh()
        paired = 0
        for peer in list(self.peers.values()):
            try:
                await peer.ensure_paired(self.timeout_s, self.writer)
                paired += 1
            except PrefillFailed as e:
                log.warning("not paired at start-up, pairing on first use: %s", e)
        log.info("warm-up: KV receive (writer thread, %d of %d prefill servers paired) in %.2fs", paired,
                 len(self.peers), time.perf_counter() - started)

    async def pick(self) -> PrefillPeer:
        """Of the prefill servers in the rotation, the one with the fewest prefills in flight. When none is
        in it, a moment's wait for one to pass its next health check."""
        await self._refresh()
        if not self.peers:
            raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"no prefill server found at {', '.join(self.targets)}")
        back_by = time.monotonic() + REJOIN_WAIT_S
        while not (peers := [p for p in self.peers.values() if p.health.up]) and time.monotonic() < back_by:
            await asyncio.sleep(0.05)
        if not peers:
            down = ", ".join(p.address for p in self.peers.values())
            raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"no prefill server is answering ({down} failed or fell "
                                                             "silent; each rejoins once its health checks pass)")
        start = next(self._rr) % len(peers)
        return min(peers[start:] + peers[:start], key=lambda p: p.in_flight)

    def reported_backlog_tokens(self) -> int:
        """The smallest backlog a prefill server in the rotation last reported (where a prompt sent now would
        wait least); 0 when none reported lately."""
        return min((p.backlog_tokens() for p in self.peers.values() if p.health.up), default=0)

    async def prefill(self, request_id: str, prompt: TokenIds, sampling: decode_pb2.SamplingParams,
                      block_table: list[int], cached_tokens: int, timing: Timing, cache_salt: str = "") -> int:
        """Prefill remotely into `block_table`, whose first `cached_tokens` tokens' KV is here already
        (only the rest comes over); returns the first token, sampled by the prefill server, and
        records where the time went in `timing`; `cache_salt` is the prompt's cache namespace there. A
        prefill server that fails or falls silent (UNAVAILABLE) leaves the rotation until it answers
        health checks again, so a retry goes to another. If the KV might still land after a failure, the
        caller learns it from PrefillFailed (`blocks_free` False): `block_table`'s blocks must stay out of
        circulation.

        The steps: pick a prefill server, pair with it, open the KV handoff into the blocks, call
        Prefill and receive its stream (`_receive`), wait for the KV to land, verify its checksums,
        record the times (`_record`); whatever happened, settle the handoff (`_settle`)."""
        peer = await self.pick()
        peer.in_flight += 1
        began = time.monotonic()
        deadline = began + self.timeout_s
        handoff: Handoff | None = None
        call = None
        failed = True
        try:
            pairing = await peer.ensure_paired(self.timeout_s, self.writer)
            handoff = pairing.handoff(self.runner.pool, block_table, len(prompt), self.writer, cached_tokens)
            # a repeated field goes into the message in one copy (serving.token_ids)
            request = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling,
                                                 transport=pairing.transport, peer_id=peer.peer_id,
                                                 kv_checksums=self.verify_kv, decode_cached_tokens=cached_tokens,
                                                 cache_salt=cache_salt)
            request.MergeFrom(handoff.request_fields(request_id))
            call = peer.prefill_call(request, timeout=self.timeout_s)
            done, done_at = await self._receive(peer, call, handoff, deadline)
            await handoff.wait_complete(deadline)
            landed = time.monotonic()
            if self.verify_kv:  # before the first token goes anywhere
                expected = list(done.layer_checksums)
                await asyncio.get_running_loop().run_in_executor(self.writer, handoff.verify, expected)
            failed = False
            self._record(timing, request_id, pairing.transport, handoff, done, began, done_at, landed)
            timing.cached_tokens = max(cached_tokens, done.cached_tokens)
            return done.first_token_id
        except (Silent, grpc.aio.AioRpcError, HandoffError) as e:
            if isinstance(e, Silent) and handoff is not None:
                handoff.peer_silent = True
            raise self._failure(peer, e) from e
        except asyncio.CancelledError:
            failed = False  # the client left; the transfer itself is healthy
            raise
        finally:
            peer.in_flight -= 1
            if call is not None and not call.done() and (handoff is None or handoff.cancels_call):
                call.cancel()
            if handoff is not None and not await asyncio.shield(self._settle(peer, handoff, request_id, failed)):
                # replaces the failure (or cancel) under way: the caller must learn the blocks are not free
                raise PrefillFailed(grpc.StatusCode.UNAVAILABLE if failed else grpc.StatusCode.CANCELLED,
                                    f"prefill server {peer.address}: a KV transfer into this request's blocks "
                                    "has not stopped", blocks_free=False, settled_late=handoff.settled_late())

    @staticmethod
    async def _receive(peer: PrefillPeer, call: AsyncIterable[Any], handoff: Handoff,
                       deadline: float) -> tuple[prefill_pb2.PrefillDone, float]:
        """The Prefill stream, message by message until it ends: KV into the handoff, backlog reports to
        the peer. Returns its result and when it came (monotonic)."""
        done, done_at = None, 0.0
        async for message in until_silent(call):
            if not handoff.marks:
                handoff.mark("first message")
            if isinstance(message, KVView):  # our own encoding of a KV chunk (grpc_wire)
                await handoff.on_kv(message)
            elif (kind := message.WhichOneof("payload")) == "done":
                done = message.done
                done_at = time.monotonic()
                handoff.mark("done")
                peer.report_backlog(done.backlog_tokens)
            elif kind == "heartbeat":
                peer.report_backlog(message.heartbeat.backlog_tokens)
            else:
                await handoff.on_message(message, deadline)
        if done is None:
            raise HandoffError(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended without its result")
        return done, done_at

    @staticmethod
    def _record(timing: Timing, request_id: str, transport: str, handoff: Handoff, done: prefill_pb2.PrefillDone,
                began: float, done_at: float, landed: float) -> None:
        """Where the time went: the handoff is all the time from the call to the KV landed (`landed`)
        that was not the prefill's queue, compute or checksum."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("handoff of %s, ms from the prefill call (prefill server: queue %.1f, compute %.1f): %s",
                      request_id, done.queue_s * 1e3, done.prefill_s * 1e3,
                      " ".join(f"{what}@{(t - began) * 1e3:.1f}" for what, t in [*handoff.marks, ("complete", landed)]))
        exposed = done.kv_send_s + (landed - done_at)
        handoff_s = landed - began - done.queue_s - done.prefill_s - done.checksum_s
        timing.remote_prefill_done(queue_s=done.queue_s, prefill_s=done.prefill_s,
                                   kv_transfer_s=max(0.0, handoff_s), kv_exposed_s=max(0.0, exposed),
                                   kv_bytes=handoff.bytes, transport=transport,
                                   start_at_s=max(0.0, handoff.start_at - began) if handoff.start_at else 0.0,
                                   post_s=handoff.post_s, post_busy_s=handoff.post_busy_s)

    @staticmethod
    def _failure(peer: PrefillPeer, e: Silent | grpc.aio.AioRpcError | HandoffError) -> PrefillFailed:
        """What a failed prefill tells the caller; a silent or unreachable peer leaves the rotation, and a
        pairing that may be broken is dropped (DATA_LOSS included: the next prefill pairs anew)."""
        if isinstance(e, Silent):
            peer.forget_pairing()
            peer.health.down(str(e))
            return PrefillFailed(grpc.StatusCode.UNAVAILABLE, f"prefill server {peer.address}: {e}")
        if isinstance(e, grpc.aio.AioRpcError):
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
                peer.forget_pairing()
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                peer.health.down(f"{e.code().name}: {e.details()}")
            return peer_error(peer.address, e, "prefill")
        peer.forget_pairing()
        return PrefillFailed(e.code, f"prefill server {peer.address}: {e}")

    async def _settle(self, peer: PrefillPeer, handoff: Handoff, request_id: str, failed: bool) -> bool:
        """Make sure nothing writes into the blocks once the caller frees them, then let the prefill
        server free its own; False when a transfer may still land in ours (they must not be reused)."""
        await asyncio.get_running_loop().run_in_executor(self.writer, lambda: None)  # writer calls have run
        blocks_free = handoff.settled() or await handoff.abandon(failed)
        task = asyncio.get_running_loop().create_task(self._release(peer, request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return blocks_free

    async def _release(self, peer: PrefillPeer, request_id: str) -> None:
        """Tell the prefill server it may free the request's blocks; a server that can't hear it now (frozen,
        restarting) is told again until it does, or until its lease would have freed them anyway."""
        request = prefill_pb2.ReleaseRequest(request_id=request_id, peer_id=peer.peer_id)
        give_up = time.monotonic() + KV_LEASE_S  # then the prefill server's lease frees them
        while True:
            try:
                await peer.stub.Release(request, timeout=RELEASE_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as e:
                retry = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry or time.monotonic() > give_up:
                    log.warning("Release of %s to %s failed (%s); its lease frees the blocks", request_id,
                                peer.address, e.code().name)
                    return
            await asyncio.sleep(RELEASE_TIMEOUT_S)

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        for peer in self.peers.values():
            peer.forget_pairing()
            peer.health.close()
            await peer.channel.close()
        self.writer.shutdown(wait=True)
