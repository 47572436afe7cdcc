"""`cache_salt`, a request's prefix-cache namespace, through the running servers: the same prompt under
another salt reuses nothing in either server's cache, under the same salt it does (over gRPC and the
OpenAI API), and a malformed salt is INVALID_ARGUMENT / 400 naming the field while the servers carry on."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.kv_cache import KVLayout
from engine.presets import TINY
from engine.transport.handshake import layout_to_proto
from launcher.process import start_all, stop_all
from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import Server

pytestmark = pytest.mark.e2e  # starts server processes

HITS = "prefix_cache_hit_tokens_total"


@pytest.fixture(scope="module")
def servers(server_logs: Path) -> Iterator[tuple[HttpServer, Server]]:
    """(decode, prefill): both with their prefix caches on (the default), the decode server's HTTP API on."""
    prefill = Server("prefill_server", [], server_logs)
    decode = HttpServer(server_logs, "--prefill-addr", prefill.address)
    start_all([prefill, decode])
    yield decode, prefill
    stop_all([decode, prefill])


def generate(server: Server, prompt: list[int], mode: str, salt: str) -> decode_pb2.ServerTiming:
    request = decode_pb2.GenerateRequest(token_ids=prompt, max_new_tokens=2, ignore_eos=True, cache_salt=salt,
                                         prefill_mode=decode_pb2.PrefillMode.Value(f"PREFILL_MODE_{mode.upper()}"))
    with grpc.insecure_channel(server.address) as channel:
        replies = list(decode_pb2_grpc.DecodeStub(channel).Generate(request, timeout=60))
    assert len(replies) == 2
    return replies[-1].timing


def hits(server: Server) -> float:
    return server.metrics()[HITS]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_another_salt_reuses_nothing_and_the_same_salt_reuses_the_prompt(servers: tuple[HttpServer, Server],
                                                                         mode: str) -> None:
    decode, prefill = servers
    prompt = [random.Random(mode).randrange(256) for _ in range(70)]  # 4 full blocks of 16 before its last token
    assert generate(decode, prompt, mode, "tenant-a").cached_tokens == 0
    before = hits(decode), hits(prefill)
    for salt in ("tenant-b", ""):  # another namespace, and none at all
        assert generate(decode, prompt, mode, salt).cached_tokens == 0, salt
    assert (hits(decode), hits(prefill)) == before  # neither server found a block of tenant-a's
    assert generate(decode, prompt, mode, "tenant-a").cached_tokens == 64
    assert hits(decode) == before[0] + 64
    if mode == "disaggregated":  # the prefill server found it in its own cache too, under the same salt
        assert hits(prefill) == before[1] + 64


def test_the_openai_api_takes_the_salt(servers: tuple[HttpServer, Server]) -> None:
    decode, _ = servers
    client = decode.client()
    prompt = [random.Random(3).randrange(256) for _ in range(40)]

    def complete(salt: str) -> None:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                  extra_body={"cache_salt": salt, "prefill_mode": "colocated"})

    complete("chat-1")
    before = hits(decode)
    complete("chat-2")
    assert hits(decode) == before
    complete("chat-1")
    assert hits(decode) == before + 32


BAD_SALTS = [("x" * 257, "257 characters; the limit is 256"), ("tab\there", "'\\t' at character 3"),
             ("caf\u00e9", "'\u00e9' at character 3")]


@pytest.mark.parametrize(("salt", "words"), BAD_SALTS, ids=["too-long", "control", "non-ascii"])
def test_a_malformed_salt_is_refused_on_both_servers(servers: tuple[HttpServer, Server], salt: str,
                                                     words: str) -> None:
    decode, prefill = servers
    with pytest.raises(grpc.RpcError) as caught:
        generate(decode, [1, 2, 3], "colocated", salt)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "cache_salt" in caught.value.details() and words in caught.value.details()  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as http_caught:
        decode.client().completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2,
                                           extra_body={"cache_salt": salt})
    body: Any = http_caught.value.body
    assert body["param"] == "cache_salt" and words in body["message"]
    layout = layout_to_proto(KVLayout.for_model(TINY, torch.float32, 16))
    with grpc.insecure_channel(prefill.address) as channel:  # as a decode server would ask it
        stub = prefill_pb2_grpc.PrefillStub(channel)
        stub.Handshake(prefill_pb2.HandshakeRequest(layout=layout, transports=["grpc"], peer_id="salt-peer"),
                       timeout=10)
        with pytest.raises(grpc.RpcError) as prefill_caught:
            list(stub.Prefill(prefill_pb2.PrefillRequest(request_id="bad-salt", token_ids=[1, 2, 3], transport="grpc",
                                                         peer_id="salt-peer", cache_salt=salt), timeout=30))
    assert prefill_caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert words in prefill_caught.value.details()  # type: ignore[attr-defined]
    assert generate(decode, [1, 2, 3], "disaggregated", "fine").cached_tokens == 0  # both still serve


@pytest.mark.parametrize("salt", ["", 7])
def test_the_openai_api_refuses_an_empty_or_non_string_salt(servers: tuple[HttpServer, Server], salt: object) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        servers[0].client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, extra_body={"cache_salt": salt})
    body: Any = caught.value.body
    assert body["param"] == "cache_salt" and "cache_salt must be a non-empty string" in body["message"]
