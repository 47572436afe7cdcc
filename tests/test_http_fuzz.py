"""Fuzz the OpenAI HTTP API (hypothesis) against a real decode server, as tests/test_fuzz.py does the
gRPC surface: random fields, types, sizes and raw bytes always get a defined answer (200, or 400 /
404 / 429 in OpenAI's error body, one line) within a per-call timeout; never a 500, a hang, a broken
stream, or a leaked KV block; and the server then answers as before."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import wait_kv_idle

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]

VOCAB, CONTEXT = 320, 40960
DEFINED = {200, 400, 404, 413, 415, 429}
MAX_EVENTS = 30   # a long stream: read this many events, then hang up (that path is fuzzed too)
CALL_TIMEOUT = 30.0
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "n", "stream", "stream_options", "ignore_eos", "stop_token_ids", "prefill_mode",
          "chunk_size", "logprobs", "user", "presence_penalty", "echo", "tools", "tool_choice", "response_format",
          "repetition_penalty", "min_p", "min_tokens", "guided_json", "guided_choice", "structured_outputs",
          "bad_words", "allowed_token_ids", "prompt_logprobs", "skip_special_tokens", "add_generation_prompt",
          "logit_bias", "top_logprobs", "cache_salt", "include_stop_str_in_output", "truncate_prompt_tokens",
          "return_tokens_as_token_ids", "continue_final_message", "chat_template_kwargs", "tokens",
          "add_special_tokens", "return_token_strs"]
# every field anything, but never a long non-streamed answer (the only thing that would merely be slow)
def short(body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("max_tokens")
    return {**body, "max_tokens": 60} if isinstance(tokens, int) and 60 < tokens <= CONTEXT else body


wild = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=8).map(short)
samplings = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.floats(0, 3), st.just(0)), "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 400), "seed": st.integers(0, 2**64 - 1),
    # fields not implemented, at their do-nothing values or not
    "frequency_penalty": st.sampled_from([0, 0.0, 0.5]), "min_p": st.sampled_from([0, 0.1]),
    "logprobs": st.sampled_from([None, 0, 2])})
texts = st.text(min_size=1, max_size=200)
common = st.fixed_dictionaries({"max_tokens": st.integers(1, 40)}, optional={
    "model": st.sampled_from(["tiny", "tiny", "other"]), "stop": st.one_of(texts, st.lists(st.text(max_size=4),
                                                                                              max_size=3)),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "stop_token_ids": st.lists(st.integers(0, VOCAB - 1),
                                                                                      max_size=3),
    "prefill_mode": st.sampled_from(["colocated", "chunked", "layered"]), "chunk_size": st.integers(0, 64)})
completions = st.tuples(common, samplings, st.fixed_dictionaries({"prompt": st.one_of(
    texts, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=300))})).map(lambda t: {**t[0], **t[1], **t[2]})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text(max_size=100)}), min_size=1, max_size=4)
chats = st.tuples(common, samplings, st.fixed_dictionaries({"messages": messages})).map(
    lambda t: {**t[0], **t[1], **t[2]})
long_streams = st.fixed_dictionaries({"prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=50),
                                      "max_tokens": st.integers(CONTEXT - 600, CONTEXT - 50),
                                      "stream": st.just(True), "ignore_eos": st.just(True)})
bodies = st.one_of(
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                               "/detokenize"]), wild),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries({"input": st.one_of(texts, messages)}, optional={
        "max_output_tokens": st.integers(1, 40), "stream": st.booleans(), "instructions": texts,
        "temperature": st.floats(0, 2)})),
    st.tuples(st.just("/v1/completions"), completions),
    st.tuples(st.just("/v1/completions"), long_streams),
    st.tuples(st.just("/v1/chat/completions"), chats),
    st.tuples(st.just("/tokenize"), st.one_of(st.fixed_dictionaries({"prompt": texts}),
                                             st.fixed_dictionaries({"messages": messages}))),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({"tokens": st.lists(st.integers(-5, VOCAB + 5),
                                                                                 max_size=50)})),
)


def check_error(raw: bytes) -> None:
    error = json.loads(raw)["error"]
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"], error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error


def check_stream(response: http.client.HTTPResponse) -> None:
    """One event a token, finish_reason on the last only, then (usage and) [DONE]; or cut short by us."""
    events: list[dict[str, Any]] = []
    while line := response.readline():
        text = line.decode().rstrip("\n")
        if not text:
            continue
        assert text.startswith("data: "), text
        if text == "data: [DONE]":
            last = events[-1]
            assert last["choices"] == [] or last["choices"][0]["finish_reason"], last
            assert all(not e["choices"] or not e["choices"][0]["finish_reason"] for e in events[:-2]), events
            return
        event = json.loads(text[6:])
        assert "error" not in event, event
        events.append(event)
        if len(events) == MAX_EVENTS:
            return  # hang up mid-stream
    raise AssertionError("the stream ended without data: [DONE]")


def check_response(response: http.client.HTTPResponse) -> None:
    """A Response whole, or its events in sequence ending with the whole Response."""
    if not response.getheader("Content-Type", "").startswith("text/event-stream"):
        assert json.loads(response.read())["status"] in ("completed", "incomplete")
        return
    events = [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), events
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]


def send(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_TIMEOUT)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        assert response.status in DEFINED, (response.status, response.read())
        if response.status != 200:
            check_error(response.read())
        elif path == "/v1/responses":
            check_response(response)
        elif path in ("/tokenize", "/detokenize"):
            answer = json.loads(response.read())
            assert isinstance(answer["count"], int) if path == "/tokenize" else isinstance(answer["prompt"], str)
        elif response.getheader("Content-Type", "").startswith("text/event-stream"):
            check_stream(response)
        else:
            choice = json.loads(response.read())["choices"][0]
            assert choice["finish_reason"] in ("length", "stop"), choice
        return response.status
    finally:
        conn.close()


def test_fuzz_openai_fields(http_server: HttpServer) -> None:
    reference = answer(http_server)
    seen: dict[int, int] = {}

    @FUZZ
    @given(request=bodies)
    def one(request: tuple[str, dict[str, Any]]) -> None:
        path, body = request
        status = send(http_server.http_port, path, json.dumps(body).encode())
        seen[status] = seen.get(status, 0) + 1

    one()
    print("fuzz statuses:", seen)
    assert seen.get(400, 0) > 0 and seen.get(200, 0) > 0, seen
    after_fuzzing(http_server, reference)


def test_fuzz_openai_raw_bytes(http_server: HttpServer) -> None:
    reference = answer(http_server)
    valid = json.dumps({"prompt": [1, 2, 3], "max_tokens": 3}).encode()

    @FUZZ
    @given(payload=st.one_of(st.binary(max_size=300), st.binary(max_size=len(valid)).map(
        lambda b: valid[:len(b)] + b)),
        path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"]),
        encoding=st.sampled_from([None, None, "gzip", "deflate", "br", "x-zstd"]),
        compressed=st.booleans())
    def one(payload: bytes, path: str, encoding: str | None, compressed: bool) -> None:
        if compressed and encoding in ("gzip", "deflate"):
            payload = gzip.compress(payload) if encoding == "gzip" else zlib.compress(payload)
        send(http_server.http_port, path, payload, {"Content-Encoding": encoding} if encoding else None)

    one()
    after_fuzzing(http_server, reference)


def answer(server: HttpServer) -> str:
    got = server.client().completions.create(model="tiny", prompt=list(range(40)), max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
    return got.choices[0].text


def after_fuzzing(server: HttpServer, reference: str) -> None:
    """Still serving, nothing leaked, and the same answer as before."""
    wait_kv_idle(server, timeout=10)
    assert answer(server) == reference
    assert server.proc is not None and server.proc.poll() is None
    assert "Traceback" not in server.own_log(), server.own_log()[-4000:]
