"""The service end to end: real processes, real sockets, every mode."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pd.v1 import decode_pb2, decode_pb2_grpc

from engine.offline import generate, make_runner
from tests.servers import ROOT, ServerProcess, free_port, served_pair

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODES = [decode_pb2.PREFILL_MODE_DISAGGREGATED, decode_pb2.PREFILL_MODE_COLOCATED, decode_pb2.PREFILL_MODE_CHUNKED,
         decode_pb2.PREFILL_MODE_LAYERED, decode_pb2.PREFILL_MODE_PARTITIONED]


def run_stream(address: str, request: decode_pb2.GenerateRequest) -> list[decode_pb2.GenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(decode_pb2_grpc.DecodeStub(ch).Generate(request, timeout=60))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


@pytest.mark.parametrize("mode", MODES, ids=["disaggregated", "colocated", "chunked", "layered", "partitioned"])
def test_tokens_equal_offline_reference(pair, mode: int) -> None:  # type: ignore[no-untyped-def]
    decode, _ = pair
    p = prompt(300)
    replies = run_stream(decode.address, decode_pb2.GenerateRequest(
        token_ids=p, max_new_tokens=24, ignore_eos=True, prefill_mode=mode, chunk_size=64))
    reference = generate(make_runner(preset="tiny", max_model_len=2048), [p], 24)[0]
    assert [r.token_id for r in replies] == reference
    assert [r.index for r in replies] == list(range(24))
    assert replies[-1].finish_reason == "length" and all(not r.finish_reason for r in replies[:-1])


def test_partitioned_without_green_contexts_says_so_once_and_refuses_no_count(pair) -> None:  # type: ignore[no-untyped-def]
    """On the CPU partitioned prompts are prefilled by layers, which the log says at start-up; a
    request's prefill_sms is then not checked against any device, only for its sign."""
    decode, _ = pair
    fallback = [line for line in decode.log().splitlines() if "partitioned prefill falls back to layered" in line]
    assert len(fallback) == 1 and "CUDA device" in fallback[0]
    p = prompt(90, 3)
    replies = run_stream(decode.address, decode_pb2.GenerateRequest(
        token_ids=p, max_new_tokens=5, ignore_eos=True, prefill_mode=decode_pb2.PREFILL_MODE_PARTITIONED,
        prefill_sms=12))
    assert [r.token_id for r in replies] == generate(make_runner(preset="tiny", max_model_len=2048), [p], 5)[0]
    with pytest.raises(grpc.RpcError) as refused:
        run_stream(decode.address, decode_pb2.GenerateRequest(
            token_ids=p, max_new_tokens=5, prefill_mode=decode_pb2.PREFILL_MODE_PARTITIONED, prefill_sms=-8))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prefill_sms" in str(refused.value.details())


def test_b_tokens_identical_across_modes_while_others_decode(pair) -> None:  # type: ignore[no-untyped-def]
    """Many concurrent streams in one batch; each request's tokens are what it gets alone."""
    decode, _ = pair
    from client.stream import collect, open_channel

    async def go() -> list[list[list[int]]]:
        channel = open_channel(decode.address)
        stub = decode_pb2_grpc.DecodeStub(channel)
        requests = [decode_pb2.GenerateRequest(token_ids=prompt(40 + 30 * i, i), max_new_tokens=12 + i,
                                               ignore_eos=True, prefill_mode=MODES[i % len(MODES)], chunk_size=32)
                    for i in range(9)]
        alone = [(await collect(stub, r)).tokens for r in requests]
        together = [r.tokens for r in await asyncio.gather(*(collect(stub, r) for r in requests))]
        await channel.close()
        return [alone, together]

    alone, together = asyncio.run(go())
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts really give different outputs


def test_text_prompt_streams_text(pair) -> None:  # type: ignore[no-untyped-def]
    decode, _ = pair
    replies = run_stream(decode.address, decode_pb2.GenerateRequest(prompt="héllo wörld", max_new_tokens=8))
    assert replies and all(r.timing.since_arrival_s > 0 for r in replies)
    tokens = [r.token_id for r in replies]
    from engine.byte_tokenizer import byte_tokenizer

    assert "".join(r.text for r in replies) == byte_tokenizer().decode(tokens).rstrip("\ufffd")


def test_stop_and_eos(pair) -> None:  # type: ignore[no-untyped-def]
    decode, _ = pair
    p = prompt(50)
    full = [r.token_id for r in run_stream(decode.address, decode_pb2.GenerateRequest(
        token_ids=p, max_new_tokens=16, ignore_eos=True))]
    stop_at = full[5]
    first = full.index(stop_at)
    replies = run_stream(decode.address, decode_pb2.GenerateRequest(
        token_ids=p, max_new_tokens=16, ignore_eos=True, stop_token_ids=[stop_at]))
    assert [r.token_id for r in replies] == full[:first + 1]
    assert replies[-1].finish_reason == "stop"


def test_health_and_reflection_on_both(pair) -> None:  # type: ignore[no-untyped-def]
    for server, service in zip(pair, ("pd.v1.Decode", "pd.v1.Prefill"), strict=True):
        with grpc.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                list_services="")]), timeout=5))
            names = {s.name for s in replies[0].list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_scenario_refuses_a_b_served_from_a_prefix_cache() -> None:
    """Every row sends the same B under a fresh cache_salt; a B whose KV was found anyway (a server
    that ignores the salt) was not prefilled, and the scenario says so instead of reporting a stall-free B."""
    from client.scenario import make_row
    from client.stream import StreamResult

    a, b = StreamResult(sent_at=0.0), StreamResult(sent_at=0.0)
    for i in range(4):
        a.add(decode_pb2.GenerateResponse(token_id=7, index=i), 0.1 * (i + 1))
    b.add(decode_pb2.GenerateResponse(token_id=3, timing=decode_pb2.ServerTiming(cached_tokens=240)), 0.25)
    with pytest.raises(RuntimeError, match=r"prefix cache \(240 tokens\) although its cache_salt was fresh"):
        make_row("colocated", None, 256, a, b, [7] * 4, 0.1, [3], 1)


def test_scenario_replays_against_servers_with_their_prefix_caches(pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Twice against the same servers, caches on: every row is prefilled (the check above holds), its tokens
    identical to A alone's and to B's reference."""
    decode, _ = pair
    for run in range(2):
        out = tmp_path / f"out{run}.json"
        proc = subprocess.run([sys.executable, "-m", "client.scenario", "--target", decode.address, "--b-len", "256",
                               "--a-len", "64", "--a-new-tokens", "24", "--modes", "alone,colocated,disaggregated",
                               "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(out.read_text())["rows"]
        assert all(r["a_tokens_match_solo"] for r in rows)
        assert all(r["b_tokens_match_reference"] and r["b_server_prefill_ms"] > 0 for r in rows[1:])


def test_the_scenario_against_an_address_nobody_listens_on_ends_in_one_line() -> None:
    """The scenario waits for a decode server still loading its model, saying so after a few seconds, then
    ends in one line naming the address and what to do (it waited 60 s in silence). The load generator does
    not wait: a deployment nobody answers for counts its requests as UNAVAILABLE (below)."""
    from client.stream import Unreachable, open_channel, wait_ready

    target = f"127.0.0.1:{free_port()}"
    said: list[str] = []

    async def attempt() -> None:
        channel = open_channel(target)
        try:
            await wait_ready(channel, target, said.append, timeout_s=1.0)
        finally:
            await channel.close()

    with pytest.raises(Unreachable) as e:
        asyncio.run(attempt())
    assert said == [f"waiting up to 1 s for a server at {target} ..."]
    assert str(e.value) == (f"no server accepts connections at {target} (waited 1 s); start the servers "
                            "(make serve-prefill serve-decode) or pass --target")

def test_scenario_cli_all_rows(scenario_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    decode, _ = scenario_pair
    out, plot = tmp_path / "out.json", tmp_path / "gaps.png"
    proc = subprocess.run([sys.executable, "-m", "client.scenario", "--target", decode.address, "--b-len", "1024",
                           "--a-len", "256", "--a-new-tokens", "40", "--json", str(out), "--plot", str(plot)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["chunk_size"]) for r in rows] == [
        ("alone", None), ("disaggregated", None), ("colocated", None), ("chunked", 512), ("chunked", 2048),
        ("layered", None)]
    fields = {"mode", "chunk_size", "b_len", "a_median_gap_ms", "a_worst_gap_ms", "a_slow_gaps", "b_ttft_ms",
              "a_tokens_match_solo", "b_first_token_matches"}
    for row in rows:
        assert fields <= row.keys()
        assert row["a_tokens_match_solo"] is True
        assert len(row["a_gaps_ms"]) == 39
        server = row["a_server_gaps_ms"]  # the decode server's stamps: the same stream, no client in them
        assert len(server) == 39 and min(server) >= 0
        assert abs(sum(server) - sum(row["a_gaps_ms"])) < 0.25 * sum(row["a_gaps_ms"]) + 50
    assert all(r["b_first_token_matches"] is True and r["b_ttft_ms"] > 0 for r in rows[1:])
    assert all(r["b_tokens_match_reference"] is True for r in rows[1:])
    assert "A alone" in proc.stdout and "chunked, 2,048" in proc.stdout
    assert plot.stat().st_size > 10_000


def test_one_prompt_cli(pair) -> None:  # type: ignore[no-untyped-def]
    decode, _ = pair
    proc = subprocess.run([sys.executable, "-m", "client.generate", "--target", decode.address, "--token-ids",
                           "1,2,3,4", "--max-new-tokens", "5", "--ignore-eos", "--show-ids"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "finish_reason=length" in proc.stdout


def test_busy_port_is_one_clear_line(pair, server_logs: Path) -> None:  # type: ignore[no-untyped-def]
    decode, _ = pair
    port = decode.address.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "decode_server", "--port", port, "--metrics-port", "0",
                           "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert f"can't listen on 127.0.0.1:{port}" in proc.stderr


def test_missing_checkpoint_is_one_clear_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "prefill_server", "--port", "0", "--metrics-port", "0",
                           "--device", "cpu", "--model", str(tmp_path / "nope")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --model")
    assert "no such folder" in proc.stderr


def test_short_first_without_green_contexts_is_one_clear_line() -> None:
    """--partitioned-short-first orders prompts on the partition's thread; where there is none (the CPU) it would
    change nothing, so it is refused rather than taken and ignored."""
    proc = subprocess.run([sys.executable, "-m", "decode_server", "--port", "0", "--metrics-port", "0", "--http-port",
                           "0", "--device", "cpu", "--partitioned-short-first"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --partitioned-short-first: this device has no green contexts"), proc.stderr[-800:]


def test_checkpoint_served_end_to_end(tiny_checkpoint: Path, server_logs: Path) -> None:
    """A real checkpoint folder through both servers equals transformers' greedy tokens."""
    from tests.test_parity import hf_greedy

    with served_pair(["--model", str(tiny_checkpoint)], server_logs) as decode:
        p = prompt(30)
        replies = run_stream(decode, decode_pb2.GenerateRequest(token_ids=p, max_new_tokens=20, ignore_eos=True))
        assert [r.token_id for r in replies] == hf_greedy(tiny_checkpoint, p, 20)


def test_kv_checksum_on_checks_every_handoff(pair, server_logs: Path) -> None:  # type: ignore[no-untyped-def]
    """--kv-checksum on: the prefill server checksums what it sent and the decode server what landed
    (a request whose prefill server left the checksum out would fail DATA_LOSS)."""
    _, prefill = pair
    decode = ServerProcess("decode_server", ["--prefill-addr", prefill.address, "--kv-checksum", "on"],
                           server_logs).start()
    try:
        p = prompt(200, salt=3)
        replies = run_stream(decode.address, decode_pb2.GenerateRequest(
            token_ids=p, max_new_tokens=8, ignore_eos=True, prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED))
        assert [r.token_id for r in replies] == generate(make_runner(preset="tiny", max_model_len=2048), [p], 8)[0]
        assert replies[-1].timing.kv_bytes > 0
    finally:
        decode.stop()
