"""The reliability contract, against real server processes: every way a request can end is one gRPC
status, and whatever the ending, its KV blocks go back to the pool. Bad requests, admission limits,
oversize messages, cancels, disconnects, deadlines, an engine crash, the internal handshake, and
what is never unpickled. KV is read back through each server's Prometheus endpoint."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from tests.servers import ROOT
from tests.test_reliability_fixtures import (
    Server,
    health_status,
    prompt,
    request,
    wait_kv_idle,
    wait_until,
)

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures"]

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
DISAGG, COLOC, CHUNKED, LAYERED = (decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED,
                                   decode_pb2.PREFILL_MODE_CHUNKED, decode_pb2.PREFILL_MODE_LAYERED)


def call(address: str, req: decode_pb2.GenerateRequest | bytes, timeout: float = 30.0,
         ) -> tuple[list[decode_pb2.GenerateResponse], grpc.StatusCode, str]:
    """One Generate to the end: (responses, status code, details)."""
    out: list[decode_pb2.GenerateResponse] = []
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as ch:
        if isinstance(req, bytes):
            stream = ch.unary_stream("/pd.v1.Decode/Generate", request_serializer=None,
                                     response_deserializer=decode_pb2.GenerateResponse.FromString)(req, timeout=timeout)
        else:
            stream = decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=timeout)
        try:
            for r in stream:
                out.append(r)
        except grpc.RpcError as e:
            return out, e.code(), e.details() or ""  # type: ignore[attr-defined]
    return out, OK, ""


# --- bad requests: INVALID_ARGUMENT, one line that names the problem and the limit ---------------------

TINY_VOCAB, TINY_CONTEXT = 320, 40960
S = decode_pb2.SamplingParams
BAD_REQUESTS = {
    "no tokens": (decode_pb2.GenerateRequest(max_new_tokens=4), ["no prompt"]),
    "empty text": (decode_pb2.GenerateRequest(prompt="", token_ids=[], max_new_tokens=4), ["no prompt"]),
    "both prompt and ids": (decode_pb2.GenerateRequest(prompt="hi", token_ids=[1, 2], max_new_tokens=4),
                            ["exactly one of prompt"]),
    "id above vocab": (decode_pb2.GenerateRequest(token_ids=[1, 2, 999, 4], max_new_tokens=4),
                       ["token id 999 at position 2", f"[0, {TINY_VOCAB})"]),
    "negative id": (decode_pb2.GenerateRequest(token_ids=[5, -1], max_new_tokens=4),
                    ["token id -1 at position 1"]),
    "over the context": (decode_pb2.GenerateRequest(token_ids=prompt(100), max_new_tokens=TINY_CONTEXT - 99),
                         ["100 tokens", str(TINY_CONTEXT - 99), str(TINY_CONTEXT + 1), str(TINY_CONTEXT)]),
    "prompt alone over the context": (decode_pb2.GenerateRequest(token_ids=prompt(TINY_CONTEXT + 5),
                                                                 max_new_tokens=1),
                                      [str(TINY_CONTEXT + 5), f"context limit of {TINY_CONTEXT}"]),
    "max_new_tokens 0": (decode_pb2.GenerateRequest(token_ids=[1, 2], max_new_tokens=0), ["at least 1, got 0"]),
    "max_new_tokens negative": (decode_pb2.GenerateRequest(token_ids=[1, 2], max_new_tokens=-7),
                                ["at least 1, got -7"]),
    "temperature < 0": (request(sampling=S(temperature=-0.5)), ["temperature", "-0.5"]),
    "temperature NaN": (request(sampling=S(temperature=math.nan)), ["temperature", "nan"]),
    "temperature inf": (request(sampling=S(temperature=math.inf)), ["temperature", "inf"]),
    "top_p > 1": (request(sampling=S(top_p=1.5)), ["top_p", "[0, 1]", "1.5"]),
    "top_p < 0": (request(sampling=S(top_p=-0.25)), ["top_p", "-0.25"]),
    "top_p NaN": (request(sampling=S(top_p=math.nan)), ["top_p"]),
    "top_k < 0": (request(sampling=S(top_k=-3)), ["top_k", "-3"]),
    "stop id outside vocab": (request(stop_token_ids=[3, 4000]), ["stop_token_ids[1] = 4000", f"[0, {TINY_VOCAB})"]),
    "too many stop ids": (request(stop_token_ids=[1] * 1025), ["1025 stop_token_ids", "1024"]),
    "unknown prefill_mode": (request(prefill_mode=9), ["prefill_mode 9"]),
    "negative chunk_size": (request(chunk_size=-4), ["chunk_size", "-4"]),
    "chunk_size not warmed up": (request(chunk_size=200), ["chunk_size", "power of two", "200"]),
    "request_id too long": (request(request_id="x" * 300), ["300 characters", "256"]),
    "huge text": (decode_pb2.GenerateRequest(prompt="a" * (TINY_CONTEXT * 64 + 1), max_new_tokens=1),
                  [f"{TINY_CONTEXT * 64 + 1} characters", f"{TINY_CONTEXT} tokens"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(rel_pair, case: str) -> None:  # type: ignore[no-untyped-def]
    decode, _ = rel_pair
    req, needles = BAD_REQUESTS[case]
    started = time.monotonic()
    replies, code, details = call(decode.address, req)
    assert (code, replies) == (INVALID, []), (code, details)
    assert "\n" not in details and len(details) < 300
    for needle in needles:
        assert needle in details, (needle, details)
    assert time.monotonic() - started < 5


def test_malformed_message_is_invalid_argument(rel_pair) -> None:  # type: ignore[no-untyped-def]
    decode, _ = rel_pair
    for raw in (b"\xff\xff\xff\xff", b"\x1a\x02\xff\xfe", request().SerializeToString()[:-1]):
        _, code, details = call(decode.address, raw)
        assert code == INVALID and "malformed GenerateRequest" in details, (raw, code, details)
    replies, code, _ = call(decode.address, request().SerializeToString())  # the raw path itself works
    assert code == OK and len(replies) == 8


def test_server_keeps_serving_after_bad_requests(rel_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = rel_pair
    for mode in (DISAGG, COLOC, CHUNKED, LAYERED):
        replies, code, _ = call(decode.address, request(40, 6, prefill_mode=mode))
        assert code == OK and [r.index for r in replies] == list(range(6))
    wait_kv_idle(decode, prefill)


def test_tiny_temperature_samples_without_nan(rel_pair) -> None:  # type: ignore[no-untyped-def]
    """A denormal temperature (1e-40) once overflowed logits/temperature to inf: NaN probabilities, and
    torch.multinomial raising on the engine thread killed the engine. Below 1e-5 is greedy now."""
    decode, _ = rel_pair
    greedy, code, _ = call(decode.address, request(30, 6, prefill_mode=COLOC))
    for temperature in (1e-40, 1e-6):
        replies, code, details = call(decode.address, request(30, 6, prefill_mode=COLOC,
                                                              sampling=S(temperature=temperature, seed=3)))
        assert code == OK, details
        assert [r.token_id for r in replies] == [r.token_id for r in greedy]
    assert health_status(decode.address) == "SERVING"


# --- ALREADY_EXISTS, oversize messages ------------------------------------------------------------------

def test_duplicate_request_id_in_flight(rel_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = rel_pair
    with grpc.insecure_channel(decode.address) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        first = stub.Generate(request(30, 20000, request_id="dup-1", prefill_mode=COLOC), timeout=60)
        next(first)  # in flight now
        _, code, details = call(decode.address, request(30, 4, request_id="dup-1"))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "'dup-1'" in details
        replies, code, _ = call(decode.address, request(30, 4, request_id="dup-2"))  # other ids are fine
        assert code == OK
        first.cancel()
    wait_kv_idle(decode, prefill)
    replies, code, _ = call(decode.address, request(30, 4, request_id="dup-1"))  # free again once it ended
    assert code == OK and all(r.request_id == "dup-1" for r in replies)


def test_oversize_message_is_resource_exhausted(rel_pair) -> None:  # type: ignore[no-untyped-def]
    decode, _ = rel_pair
    big = decode_pb2.GenerateRequest(prompt="a" * (65 << 20), max_new_tokens=1)
    _, code, details = call(decode.address, big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "larger than max" in details and str(64 << 20) in details
    replies, code, _ = call(decode.address, request(30, 5))
    assert code == OK and len(replies) == 5
    assert health_status(decode.address) == "SERVING"


# --- cancel, disconnect, deadline: the request leaves the batch and its KV is freed on both sides --------

@pytest.mark.parametrize("mode", [DISAGG, COLOC, CHUNKED, LAYERED], ids=["disaggregated", "colocated", "chunked",
                                                                      "layered"])
def test_cancel_mid_stream_frees_kv(rel_pair, mode: int) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = rel_pair
    wait_kv_idle(decode, prefill)
    with grpc.insecure_channel(decode.address) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(request(200, 30000, prefill_mode=mode), timeout=60)
        for _, reply in zip(range(5), stream, strict=False):
            assert reply.token_id >= 0
        m = decode.metrics()
        assert m["num_requests_running"] == 1 and m["kv_cache_free_blocks"] < m["kv_cache_total_blocks"]
        stream.cancel()
    freed_in = wait_kv_idle(decode, prefill, timeout=3)
    assert freed_in < 3


def test_client_disconnect_frees_kv(rel_pair) -> None:  # type: ignore[no-untyped-def]
    """A client process killed mid-stream: its TCP connection goes, the request goes with it."""
    decode, prefill = rel_pair
    wait_kv_idle(decode, prefill)
    script = (
        "import sys, grpc\n"
        "from pd.v1 import decode_pb2, decode_pb2_grpc\n"
        "ch = grpc.insecure_channel(sys.argv[1])\n"
        "req = decode_pb2.GenerateRequest(token_ids=list(range(1, 300)), max_new_tokens=30000, ignore_eos=True)\n"
        "for r in decode_pb2_grpc.DecodeStub(ch).Generate(req):\n"
        "    print(r.index, flush=True)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script, decode.address], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout is not None
        for _ in range(3):
            client.stdout.readline()
        assert decode.metrics()["num_requests_running"] == 1
    finally:
        client.kill()
        client.wait(10)
    wait_kv_idle(decode, prefill, timeout=3)


def test_deadline_mid_stream_frees_kv(rel_pair) -> None:  # type: ignore[no-untyped-def]
    decode, prefill = rel_pair
    wait_kv_idle(decode, prefill)
    started = time.monotonic()
    replies, code, _ = call(decode.address, request(200, 30000, request_id="deadline-1"), timeout=1.0)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and replies
    assert time.monotonic() - started < 2.5
    wait_kv_idle(decode, prefill, timeout=3)
    # the handler records the failure once it sees the deadline, which may be after the client does
    wait_until(lambda: decode.metrics().get('request_failure_total{code="DEADLINE_EXCEEDED"}', 0) >= 1, 3)
    wait_until(lambda: '"request_id": "deadline-1", "status": "DEADLINE_EXCEEDED"' in decode.log(), 3)


# --- admission: RESOURCE_EXHAUSTED at once past the queue and token limits ------------------------------

@pytest.fixture(scope="module")
def small_kv(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[Server]:
    """A checkpoint without tokenizer files (vocab 300, context 2048), a KV pool of 348 blocks (2.7 full
    sequences), at most 2 requests / 3000 tokens waiting for KV, one step at a time."""
    from tests.conftest import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "long-ctx", max_position_embeddings=4096)
    server = Server("decode_server", ["--model", str(ckpt), "--kv-cache-gb", "0.004", "--max-model-len", "2048",
                                      "--max-queued-requests", "2", "--max-waiting-tokens", "3000"], server_logs)
    server.start()
    yield server
    server.stop()


def test_text_without_tokenizer_and_checkpoint_vocab(small_kv: Server) -> None:
    _, code, details = call(small_kv.address, decode_pb2.GenerateRequest(prompt="hello", max_new_tokens=4))
    assert code == INVALID and "no tokenizer" in details and "token_ids" in details
    _, code, details = call(small_kv.address, decode_pb2.GenerateRequest(token_ids=[1, 300], max_new_tokens=4))
    assert code == INVALID and "token id 300 at position 1" in details and "[0, 300)" in details
    _, code, details = call(small_kv.address, decode_pb2.GenerateRequest(token_ids=[1] * 48, max_new_tokens=2001))
    assert code == INVALID and "48 tokens" in details and "2049" in details and "2048" in details


def test_admission_limits(small_kv: Server) -> None:
    m = small_kv.metrics()
    total = m["kv_cache_total_blocks"]
    assert total == 348 and m["kv_cache_free_blocks"] == total

    async def go() -> None:
        channel = grpc.aio.insecure_channel(small_kv.address)
        stub = decode_pb2_grpc.DecodeStub(channel)
        big = [decode_pb2.GenerateRequest(token_ids=prompt(48, i), max_new_tokens=2000, ignore_eos=True,
                                          request_id=f"big-{i}") for i in range(4)]  # 128 blocks each
        small = [decode_pb2.GenerateRequest(token_ids=prompt(20, 9 + i), max_new_tokens=30, ignore_eos=True,
                                            request_id=f"small-{i}") for i in range(2)]  # 4 blocks each
        r1, r2 = stub.Generate(big[0]), stub.Generate(big[1])
        await r1.read()
        await r2.read()
        assert small_kv.metrics()["kv_cache_free_blocks"] == total - 256
        r3 = stub.Generate(big[2])  # 92 blocks free: waits
        await asyncio.to_thread(wait_until, lambda: small_kv.metrics()["num_requests_waiting"] == 1, 5)

        async def refused(req: decode_pb2.GenerateRequest) -> str:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(req).read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - started < 1.0  # at once, not after a wait
            return e.value.details() or ""

        details = await refused(big[3])  # 2048 + 2048 waiting tokens > 3000
        assert "2048" in details and "--max-waiting-tokens 3000" in details
        r5 = stub.Generate(small[0])  # fits the budget: waits behind r3 (first come, first served)
        await asyncio.to_thread(wait_until, lambda: small_kv.metrics()["num_requests_waiting"] == 2, 5)
        details = await refused(small[1])  # two already wait
        assert "2 requests already wait" in details and "--max-queued-requests 2" in details
        r1.cancel()  # frees 128 blocks: r3 then r5 get theirs
        first = await r3.read()
        assert first.index == 0
        r5_tokens = [r async for r in r5]
        assert len(r5_tokens) == 30 and r5_tokens[-1].finish_reason == "length"
        r2.cancel()
        r3.cancel()
        await channel.close()

    asyncio.run(go())
    wait_kv_idle(small_kv, timeout=3)
    replies, code, _ = call(small_kv.address, decode_pb2.GenerateRequest(token_ids=prompt(48), max_new_tokens=5))
    assert code == OK and len(replies) >= 1


# --- the engine loop dies: health NOT_SERVING, in-flight streams UNAVAILABLE, exit non-zero -------------

def test_engine_death_and_default_loopback_bind(server_logs: Path) -> None:
    server = Server("decode_server", [], server_logs, env={"PD_FAULT_ENGINE_DIE_AFTER_STEPS": "40"}, host=None)
    server.start()
    try:
        # no --host: listening on 127.0.0.1 only (gRPC and metrics)
        for port in (server.port, server.metrics_port):
            assert listening_addresses(port) == {"127.0.0.1"}, port
        statuses: list[str] = []
        watch_channel = grpc.insecure_channel(server.address)
        watch = health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)

        def read_watch() -> None:
            try:
                for reply in watch:
                    statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read_watch)
        reader.start()
        wait_until(lambda: statuses == ["SERVING"], 5)
        replies, code, details = call(server.address, request(30, 500))
        assert code == grpc.StatusCode.UNAVAILABLE and "decode engine failed" in details, (code, details)
        assert 30 <= len(replies) <= 45  # the steps before the fault, then the error (no hang)
        assert server.wait(15) == 1
        reader.join(10)
        watch_channel.close()
        assert statuses[-1] == "NOT_SERVING"
        assert "fault injection: PD_FAULT_ENGINE_DIE_AFTER_STEPS=40" in server.log()
    finally:
        server.kill()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp and tcp6; IPv4-mapped
    IPv6 addresses, as gRPC binds 127.0.0.1, are shown as IPv4)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A = LISTEN
                continue
            raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))  # host-order words
            ip = ipaddress.ip_address(raw)
            mapped = getattr(ip, "ipv4_mapped", None)
            found.add(str(mapped or ip))
    return found


def test_default_host_is_loopback() -> None:
    from decode_server.__main__ import parse_config as decode_config
    from prefill_server.__main__ import parse_config as prefill_config

    assert decode_config([])[0].host == "127.0.0.1"
    assert prefill_config([]).host == "127.0.0.1"
    assert decode_config(["--host", "0.0.0.0"])[0].host == "0.0.0.0"
    assert (decode_config([])[0].metrics_port, prefill_config([]).metrics_port) == (8001, 8002)


def test_layer_slice_flag_is_read_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.__main__ import parse_config as decode_config

    assert decode_config([])[0].layer_slice_tokens == 32768
    assert decode_config(["--mode", "layered", "--layer-slice-tokens", "4096"])[0].layer_slice_tokens == 4096
    with pytest.raises(SystemExit):
        decode_config(["--layer-slice-tokens", "0"])
    assert "--layer-slice-tokens" in capsys.readouterr().err


def test_gil_switch_interval_is_applied_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from prefill_server.__main__ import parse_config as prefill_config
    from serving.grpc_common import setup_process

    before = sys.getswitchinterval()
    try:
        setup_process(prefill_config(["--gil-switch-ms", "0.5"]))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(SystemExit):
        prefill_config(["--gil-switch-ms", "0"])
    assert "--gil-switch-ms must be in (0, 1000]" in capsys.readouterr().err


# --- internal endpoints refuse peers that fail the handshake -------------------------------------------

def test_prefill_refuses_bad_handshakes_and_unpaired_peers(rel_pair) -> None:  # type: ignore[no-untyped-def]
    from engine.kv_cache import KVLayout
    from engine.presets import TINY
    from engine.transport.handshake import layout_to_proto

    _, prefill = rel_pair
    good = KVLayout.for_model(TINY, __import__("torch").float32, 16)
    with grpc.insecure_channel(prefill.address) as ch:
        stub = prefill_pb2_grpc.PrefillStub(ch)

        def handshake(layout: prefill_pb2.KVLayout, peer: str, transports: tuple[str, ...] = ("grpc",)) -> object:
            return stub.Handshake(prefill_pb2.HandshakeRequest(layout=layout, transports=list(transports),
                                                               peer_id=peer), timeout=10)

        def prefill(peer: str, transport: str = "grpc") -> list[prefill_pb2.PrefillResponse]:
            return list(stub.Prefill(prefill_pb2.PrefillRequest(request_id="r", token_ids=[1, 2, 3],
                                                                transport=transport, peer_id=peer), timeout=10))

        wrong = layout_to_proto(good)
        wrong.dtype, wrong.num_layers = "bfloat16", 7
        with pytest.raises(grpc.RpcError) as e:
            handshake(wrong, "liar")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        details = e.value.details()  # type: ignore[attr-defined]
        assert "prefill server 'float32'" in details and "decode server 'bfloat16'" in details
        assert "prefill server 4" in details and "decode server 7" in details
        broken = layout_to_proto(good)
        broken.dtype = "int3"
        with pytest.raises(grpc.RpcError) as e:
            handshake(broken, "broken")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as e:
            handshake(layout_to_proto(good), "nccl-only", ("nccl",))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        assert "no KV transport in common" in e.value.details()  # type: ignore[attr-defined]
        for peer in ("liar", "broken", "nccl-only", "stranger"):  # no handshake passed: no prefill
            with pytest.raises(grpc.RpcError) as e:
                prefill(peer)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            assert "call Handshake first" in e.value.details()  # type: ignore[attr-defined]
        reply = handshake(layout_to_proto(good), "honest")
        assert reply.transport == "grpc"  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as e:
            prefill("honest", "cuda-ipc")  # a transport that was not agreed
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        assert "'cuda-ipc' was not agreed" in e.value.details()  # type: ignore[attr-defined]
        replies = prefill("honest")
        assert replies[-1].WhichOneof("payload") == "done" and sum(r.HasField("kv") for r in replies) == 4


def test_nothing_from_the_network_is_unpickled() -> None:
    """No pickle, marshal or shelve in the packages, and any torch.load is weights_only=True."""
    offenders = []
    for package in ("engine", "decode_server", "prefill_server", "client", "proto"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            for line_no, line in enumerate(text.splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\b(import\s+(c?pickle|marshal|shelve|dill)|from\s+(c?pickle|marshal|shelve|dill)\b|"
                             r"pickle\.loads?|numpy\.load|np\.load)", code):
                    offenders.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
                if "torch.load(" in code and "weights_only=True" not in code:
                    offenders.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
                if re.search(r"allow_pickle\s*=\s*True", code):
                    offenders.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
    assert offenders == []


def test_second_signal_cuts_the_drain_short(small_kv: Server) -> None:
    """Last in this file: it stops the module's small_kv server. A second SIGTERM/SIGINT during the
    drain stops at once, even with a long stream in flight."""
    with grpc.insecure_channel(small_kv.address) as ch:
        stream = decode_pb2_grpc.DecodeStub(ch).Generate(request(30, 2000), timeout=60)
        next(stream)
        small_kv.signal(signal.SIGTERM)
        wait_until(lambda: health_status(small_kv.address) == "NOT_SERVING", 5)
        _, code, details = call(small_kv.address, request(30, 4))
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
        started = time.monotonic()
        small_kv.signal(signal.SIGINT)
        assert small_kv.wait(10) == 0
        assert time.monotonic() - started < 5
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
