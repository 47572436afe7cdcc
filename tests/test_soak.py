"""Soak (`make soak`): hundreds of concurrent requests across every mode with random cancels,
client disconnects, deadlines, bad requests, duplicate ids, a small KV pool (so requests queue for
KV and some are refused), and the prefill server SIGKILLed and restarted midway. Afterwards:

- every request ended with a status the reliability contract allows, and none hung;
- one JSON log line per request;
- both servers' KV pools are exactly as free as before, nothing running or waiting: every block is
  free or holds a cached prefix nobody uses (a third of the prompts continue an earlier one, so
  the prefix caches are hit, and hit by requests that are then cancelled);
- a fresh decode server gives the same tokens for completed requests, and the tokens of the
  cancelled ones are a prefix of its answer.

(A frozen prefill server: tests/test_frozen_peer.py; chaos with two prefill servers: tests/test_chaos.py.)

SOAK_REQUESTS (default 1200) and SOAK_SEED change the size and the draw.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from engine.transport.nixl import nixl_available
from launcher.process import start_all, stop_all
from tests.test_reliability_fixtures import Server, health_status, wait_kv_idle

pytestmark = pytest.mark.soak

N_REQUESTS = int(os.environ.get("SOAK_REQUESTS", "1200"))
SEED = int(os.environ.get("SOAK_SEED", "20251"))
CONCURRENCY = 24
CONTEXT = 4096
MODES = [decode_pb2.PREFILL_MODE_UNSPECIFIED, decode_pb2.PREFILL_MODE_DISAGGREGATED,
         decode_pb2.PREFILL_MODE_COLOCATED, decode_pb2.PREFILL_MODE_CHUNKED, decode_pb2.PREFILL_MODE_AUTO]
ACTIONS = ["complete"] * 50 + ["cancel"] * 15 + ["disconnect"] * 10 + ["deadline"] * 12 + ["invalid"] * 5 + \
    ["duplicate"] * 8
CALL_TIMEOUT = 120.0  # no request may need this long: reaching it counts as a hang


@dataclass
class Spec:
    index: int
    action: str
    request: decode_pb2.GenerateRequest
    read: int = 0          # cancel / disconnect after this many tokens (0: before the first)
    timeout: float = CALL_TIMEOUT


@dataclass
class Outcome:
    spec: Spec
    code: grpc.StatusCode
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    details: str = ""
    started: float = 0.0
    ended: float = 0.0


def draw(rng: random.Random, index: int, earlier: list[list[int]]) -> Spec:
    """The index-th request; a third of them continue one of the `earlier` prompts (a conversation)."""
    action = rng.choice(ACTIONS)
    n = rng.choice([rng.randint(1, 64), rng.randint(64, 800), rng.randint(800, 3000)] if rng.random() < 0.1
                   else [rng.randint(1, 64), rng.randint(64, 800)])
    start = rng.choice(earlier)[:rng.randint(1, 1500)] if earlier and rng.random() < 0.33 else []
    tokens = (start + [rng.randrange(256) for _ in range(n)])[:3000]
    earlier.append(tokens)
    new = rng.randint(1, min(96, CONTEXT - len(tokens)))
    req = decode_pb2.GenerateRequest(request_id=f"soak-{index}", token_ids=tokens,
                                     max_new_tokens=new, prefill_mode=rng.choice(MODES),
                                     chunk_size=rng.choice([0, 16, 64, 256]), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.3:
        req.sampling.CopyFrom(decode_pb2.SamplingParams(temperature=rng.choice([0.5, 0.8, 1.2]),
                                                        top_p=rng.choice([0.0, 0.9]), top_k=rng.choice([0, 40]),
                                                        seed=rng.randrange(1, 2**40)))
    if rng.random() < 0.1:
        req.stop_token_ids.extend(rng.sample(range(256), 3))
    spec = Spec(index, action, req, read=rng.randint(0, 6))
    if action == "deadline":
        spec.timeout = rng.choice([0.01, 0.05, 0.2, 0.5, 1.0])
    elif action == "invalid":
        rng.choice([
            lambda: req.token_ids.append(999),
            lambda: setattr(req, "max_new_tokens", 0),
            lambda: setattr(req, "max_new_tokens", CONTEXT),
            lambda: req.sampling.CopyFrom(decode_pb2.SamplingParams(temperature=-1)),
            lambda: setattr(req, "prompt", "both"),
        ])()
    return spec


async def run_one(address: str, stub: decode_pb2_grpc.DecodeStub, spec: Spec) -> Outcome:
    out = Outcome(spec, grpc.StatusCode.OK, started=time.monotonic())
    own_channel = grpc.aio.insecure_channel(address) if spec.action == "disconnect" else None
    call = (decode_pb2_grpc.DecodeStub(own_channel) if own_channel else stub).Generate(spec.request,
                                                                                         timeout=spec.timeout)
    try:
        if spec.action in ("cancel", "disconnect") and spec.read == 0:
            await asyncio.sleep(random.random() * 0.05)
        else:
            async for reply in call:
                out.tokens.append(reply.token_id)
                out.finish_reason = reply.finish_reason
                if spec.action in ("cancel", "disconnect") and len(out.tokens) == spec.read:
                    break
        if spec.action == "cancel" and not out.finish_reason:
            call.cancel()
            out.code = grpc.StatusCode.CANCELLED
        elif spec.action == "disconnect" and not out.finish_reason:
            assert own_channel is not None
            await own_channel.close()  # the connection goes away with the stream on it
            own_channel = None
            out.code = grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as e:
        out.code, out.details = e.code(), e.details() or ""
    finally:
        if own_channel is not None:
            await own_channel.close()
    out.ended = time.monotonic()
    return out


async def soak(decode: Server, prefill: Server, rng: random.Random) -> tuple[list[Outcome], float, float, Server]:
    """All the requests, CONCURRENCY at a time; returns the outcomes, when the prefill server was
    killed and when its replacement was SERVING, and the replacement."""
    channel = grpc.aio.insecure_channel(decode.address)
    stub = decode_pb2_grpc.DecodeStub(channel)
    gate = asyncio.Semaphore(CONCURRENCY)
    done: list[Outcome] = []
    outage: list[float] = []
    replacement: list[Server] = []

    async def one(spec: Spec) -> None:
        async with gate:
            if spec.action != "duplicate":
                done.append(await run_one(decode.address, stub, spec))
                return
            twin = Spec(spec.index, "duplicate", spec.request)  # the same request_id, at the same time
            done.extend(await asyncio.gather(run_one(decode.address, stub, spec),
                                             run_one(decode.address, stub, twin)))

    async def chaos() -> None:
        while len(done) < N_REQUESTS * 0.4:
            await asyncio.sleep(0.05)
        outage.append(time.monotonic())
        await asyncio.to_thread(prefill.kill)
        restarted = prefill.restarted()
        replacement.append(restarted)
        await asyncio.to_thread(restarted.start)
        outage.append(time.monotonic())

    chaos_task = asyncio.ensure_future(chaos())
    earlier: list[list[int]] = []
    await asyncio.gather(*(one(draw(rng, i, earlier)) for i in range(N_REQUESTS)))
    await chaos_task
    await channel.close()
    return done, outage[0], outage[1], replacement[0]


def is_disaggregated(spec: Spec) -> bool:
    """It may have gone to the prefill server (auto: when its prompt was long enough)."""
    return spec.request.prefill_mode in (decode_pb2.PREFILL_MODE_UNSPECIFIED, decode_pb2.PREFILL_MODE_DISAGGREGATED,
                                         decode_pb2.PREFILL_MODE_AUTO)


def check_outcomes(outcomes: list[Outcome], killed: float, back: float) -> None:
    codes = grpc.StatusCode
    allowed = {
        "complete": {codes.OK, codes.RESOURCE_EXHAUSTED},
        "cancel": {codes.OK, codes.CANCELLED, codes.RESOURCE_EXHAUSTED},
        "disconnect": {codes.OK, codes.CANCELLED, codes.RESOURCE_EXHAUSTED},
        "deadline": {codes.OK, codes.DEADLINE_EXCEEDED, codes.RESOURCE_EXHAUSTED},
        "invalid": {codes.INVALID_ARGUMENT},
        "duplicate": {codes.OK, codes.ALREADY_EXISTS, codes.RESOURCE_EXHAUSTED},
    }
    for o in outcomes:
        spec, ok_codes = o.spec, set(allowed[o.spec.action])
        # the prefill server's outage (and the decode side's reconnect backoff after it)
        if is_disaggregated(spec) and o.started < back + 3 and o.ended > killed:
            ok_codes.add(codes.UNAVAILABLE)
        assert o.code in ok_codes, (spec.action, o.code, o.details, spec.request)
        assert o.ended - o.started < min(spec.timeout, CALL_TIMEOUT) + 5, (spec.action, o.code)  # no hang
        if o.code == codes.UNAVAILABLE:
            assert o.ended - o.started < 10 and "prefill server" in o.details
        if o.code == codes.OK and o.finish_reason:
            assert len(o.tokens) <= spec.request.max_new_tokens
            assert o.finish_reason != "length" or len(o.tokens) == spec.request.max_new_tokens
    duplicates: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.spec.action == "duplicate":
            duplicates.setdefault(o.spec.index, []).append(o)
    assert all(len(pair) == 2 for pair in duplicates.values())
    assert not any(all(o.code == grpc.StatusCode.ALREADY_EXISTS for o in pair) for pair in duplicates.values())
    assert sum(o.code == grpc.StatusCode.ALREADY_EXISTS for o in outcomes) > 0
    seen = Counter(o.code for o in outcomes)
    for code in (codes.OK, codes.CANCELLED, codes.DEADLINE_EXCEEDED, codes.INVALID_ARGUMENT, codes.UNAVAILABLE):
        assert seen[code] > 0, (code, seen)


def compare_with_fresh_server(outcomes: list[Outcome], server_logs: Path, rng: random.Random) -> int:
    """Completed requests: the same tokens from a fresh decode server (colocated); cut-short ones:
    what they got is a prefix of that. Returns how many were compared."""
    complete = [o for o in outcomes if o.code == grpc.StatusCode.OK and o.finish_reason]
    partial = [o for o in outcomes if o.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
               and o.tokens]
    sample = rng.sample(complete, min(40, len(complete))) + rng.sample(partial, min(20, len(partial)))
    assert any(o.spec.request.sampling.temperature > 0 for o in sample)
    fresh = Server("decode_server", ["--max-model-len", str(CONTEXT)], server_logs).start()
    try:
        with grpc.insecure_channel(fresh.address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            for o in sample:
                again = decode_pb2.GenerateRequest()
                again.CopyFrom(o.spec.request)
                again.request_id = ""
                again.prefill_mode = decode_pb2.PREFILL_MODE_COLOCATED
                tokens = [r.token_id for r in stub.Generate(again, timeout=60)]
                if o.code == grpc.StatusCode.OK:
                    assert tokens == o.tokens, (o.spec.index, o.spec.request.prefill_mode)
                else:
                    assert tokens[:len(o.tokens)] == o.tokens, (o.spec.index, o.spec.action)
    finally:
        fresh.stop()
    return len(sample)


@pytest.mark.parametrize("transport", ["grpc", pytest.param("nixl", marks=pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed"))])
def test_soak(server_logs: Path, transport: str) -> None:
    """Over nixl the cancels, deadlines and the kill land mid-transfer into the decode pool too."""
    rng = random.Random(SEED)
    flag = ["--kv-transport", transport]
    prefill = Server("prefill_server", flag, server_logs)
    decode = Server("decode_server", [*flag, "--prefill-addr", prefill.address, "--max-model-len", str(CONTEXT),
                                      "--kv-cache-gb", "0.01", "--max-batch-size", "16", "--max-queued-requests", "10",
                                      "--max-waiting-tokens", "12000"], server_logs)
    start_all([prefill, decode])
    servers = [decode, prefill]
    try:
        before = [decode.metrics(), prefill.metrics()]
        lines_before = decode.log().count('"event": "request_finished"')
        started = time.monotonic()
        outcomes, killed, back, prefill = asyncio.run(soak(decode, prefill, rng))
        servers.append(prefill)
        elapsed = time.monotonic() - started
        check_outcomes(outcomes, killed, back)
        # both KV pools exactly as free as before (the prefill server's is its replacement's)
        wait_kv_idle(decode, prefill, timeout=15)
        for b, a in zip(before, [decode.metrics(), prefill.metrics()], strict=True):
            assert a["kv_cache_free_blocks"] == b["kv_cache_free_blocks"] == b["kv_cache_total_blocks"]
            assert a["kv_cache_total_blocks"] == b["kv_cache_total_blocks"]
            assert a["prefix_cache_used_blocks"] == 0 and a["prefix_cache_blocks"] <= a["kv_cache_total_blocks"]
        cache = decode.metrics()
        assert cache["prefix_cache_blocks"] > 0 and cache["prefix_cache_hit_tokens_total"] > 0
        assert health_status(decode.address) == "SERVING" and health_status(prefill.address) == "SERVING"
        # one JSON log line per request, and no stack trace
        log = decode.log()
        logged = Counter(line.split('"request_id": "', 1)[1].split('"', 1)[0]
                         for line in log.splitlines() if '"event": "request_finished"' in line)
        sent = Counter(o.spec.request.request_id for o in outcomes)
        missing = [o for o in outcomes if logged[o.spec.request.request_id] < sent[o.spec.request.request_id]]
        # a call the client gave up on within milliseconds may never reach the servicer: no request, no line
        assert all(o.spec.action in ("cancel", "disconnect", "deadline") and not o.tokens
                   and o.ended - o.started < 0.1 for o in missing), missing
        assert all(logged[rid] <= n for rid, n in sent.items())
        assert log.count('"event": "request_finished"') - lines_before == len(outcomes) - len(missing)
        assert "Traceback" not in log
        compared = compare_with_fresh_server(outcomes, server_logs, rng)
        summary = Counter(f"{o.spec.action}:{o.code.name}" for o in outcomes)
        print(f"\nsoak: {len(outcomes)} requests in {elapsed:.1f}s, prefill server down for {back - killed:.1f}s, "
              f"{compared} compared with a fresh server, {len(missing)} cancelled before the server saw them; "
              + json.dumps(dict(sorted(summary.items()))))
    finally:
        stop_all(servers)
