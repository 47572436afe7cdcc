"""The prefix cache and `auto` placement through the running servers: a conversation's later turns
reuse its earlier KV in every mode with the tokens unchanged, the decode server ships nothing it
holds, cancelled and finished requests leave every block free or cached, and `auto` keeps a short
prompt local and sends a long one remote while another user decodes."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pd.v1 import decode_pb2, decode_pb2_grpc

from launcher.process import start_all, stop_all
from tests.test_reliability_fixtures import Server, wait_kv_idle, wait_until

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODES = ("colocated", "chunked", "layered", "partitioned", "disaggregated", "auto")


@pytest.fixture(scope="module")
def servers(server_logs: Path) -> Iterator[tuple[Server, Server, Server]]:
    """(decode, prefill, reference): the pair with their caches, and a cache-less decode server."""
    prefill = Server("prefill_server", [], server_logs)
    decode = Server("decode_server", ["--prefill-addr", prefill.address, "--chunk-size", "32"], server_logs)
    reference = Server("decode_server", ["--no-prefix-cache", "--chunk-size", "32"], server_logs)
    start_all([prefill, decode, reference])
    yield decode, prefill, reference
    stop_all([decode, prefill, reference])


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def generate(server: Server, prompt: list[int], new: int, mode: str = "colocated",
             **fields: object) -> tuple[list[int], decode_pb2.ServerTiming]:
    request = decode_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=new, ignore_eos=True,
                                         prefill_mode=decode_pb2.PrefillMode.Value(f"PREFILL_MODE_{mode.upper()}"),
                                         **fields)  # type: ignore[arg-type]
    with grpc.insecure_channel(server.address) as channel:
        replies = list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60))
    return [r.token_id for r in replies], replies[-1].timing


@pytest.mark.parametrize("mode", MODES)
def test_later_turns_reuse_the_conversation_and_give_the_same_tokens(servers: tuple[Server, Server, Server],
                                                                     mode: str) -> None:
    decode, _, reference = servers
    rng = random.Random(MODES.index(mode))
    history = tokens(rng, 100)
    sampled = decode_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    written = 0  # the history's tokens whose KV the last turn left: prompt and answer, less its last token
    for turn in range(3):
        fields = {"sampling": sampled} if turn == 2 else {}
        answer, timing = generate(decode, history, 12, mode, **fields)  # first turn: 112 tokens, 7 blocks
        expected, plain = generate(reference, history, 12, **fields)
        assert answer == expected, (mode, turn)
        assert plain.cached_tokens == 0
        # the full blocks of what the last turn left, short of the block with this prompt's last token
        assert timing.cached_tokens == min(written, len(history) - 1) // 16 * 16, (mode, turn)
        written = len(history) + len(answer) - 1
        history = history + answer + tokens(rng, 30)
    assert timing.cached_tokens > 0
    assert timing.placement == ("remote" if mode == "disaggregated" else "local")  # auto: nobody else decodes


def test_the_decode_server_ships_only_what_it_lacks(servers: tuple[Server, Server, Server]) -> None:
    decode, prefill, _ = servers
    rng = random.Random(11)
    prompt = tokens(rng, 90)
    generate(decode, prompt, 4, "colocated")               # the decode server caches 5 blocks; the prefill server none
    before = prefill.metrics()
    longer = prompt + tokens(rng, 50)
    _, timing = generate(decode, longer, 4, "disaggregated")
    assert timing.cached_tokens == 80 and timing.placement == "remote"
    assert timing.kv_bytes == (140 - 80) * 4 * 2 * 2 * 16 * 4  # tiny preset, float32: 1 KiB a token
    after = prefill.metrics()
    assert after["prefix_cache_queried_tokens_total"] - before["prefix_cache_queried_tokens_total"] == 140
    assert after["prefix_cache_hit_tokens_total"] == before["prefix_cache_hit_tokens_total"]  # it computed all


def test_cancelled_and_finished_requests_leave_every_block_free_or_cached(
        servers: tuple[Server, Server, Server]) -> None:
    decode, prefill, _ = servers
    rng = random.Random(12)
    for mode in ("colocated", "disaggregated"):
        request = decode_pb2.GenerateRequest(token_ids=tokens(rng, 200), max_new_tokens=5000, ignore_eos=True,
                                             prefill_mode=decode_pb2.PrefillMode.Value(f"PREFILL_MODE_{mode.upper()}"))
        with grpc.insecure_channel(decode.address) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60)
            for i, _ in enumerate(call):
                if i == 5:
                    call.cancel()
                    break
    wait_kv_idle(decode, prefill)
    for server in (decode, prefill):
        m = server.metrics()
        assert m["prefix_cache_used_blocks"] == 0 and 0 < m["prefix_cache_blocks"] <= m["kv_cache_total_blocks"]


def test_auto_sends_a_long_fresh_prompt_remote_and_keeps_a_short_one_local(
        servers: tuple[Server, Server, Server]) -> None:
    decode, _, _ = servers
    rng = random.Random(13)
    first_token = threading.Event()

    def other_user() -> None:
        request = decode_pb2.GenerateRequest(token_ids=tokens(rng, 40), max_new_tokens=5000, ignore_eos=True,
                                             prefill_mode=decode_pb2.PREFILL_MODE_COLOCATED, request_id="other-user")
        with grpc.insecure_channel(decode.address) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=120)
            for _ in call:
                first_token.set()
                if done.is_set():
                    call.cancel()
                    return

    done = threading.Event()
    user = threading.Thread(target=other_user)
    user.start()
    try:
        assert first_token.wait(30)
        long_prompt, short_prompt = tokens(rng, 3000), tokens(rng, 64)
        _, long_timing = generate(decode, long_prompt, 4, "auto", request_id="auto-long")
        _, short_timing = generate(decode, short_prompt, 4, "auto", request_id="auto-short")
        assert user.is_alive()  # the other user was decoding all along
    finally:
        done.set()
        user.join(30)
    assert long_timing.placement == "remote" and long_timing.kv_bytes > 0
    assert short_timing.placement == "local" and short_timing.kv_bytes == 0
    wait_until(lambda: '"request_id": "auto-short"' in decode.log(), 5)
    logged = {(line := json.loads(text[text.index("{"):]))["request_id"]: line
              for text in decode.log().splitlines() if '"event": "request_finished"' in text}
    assert logged["auto-long"]["placement"] == "remote" and logged["auto-long"]["mode"] == "disaggregated"
    assert logged["auto-short"]["placement"] == "local" and logged["auto-short"]["mode"] == "colocated"
