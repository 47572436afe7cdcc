"""The OpenAI HTTP API end to end, driven by the official `openai` SDK against a real decode server:
the same tokens as gRPC, streamed and not, chat through the model's template, stop strings, every
refusal as OpenAI's error body naming the field, and the KV pool back to where it started whenever
a client walks away."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pd.v1 import decode_pb2, decode_pb2_grpc

from client.event_loop import run_event_loop
from client.load_plan import LoadSpec
from client.load_run import Deployment
from engine.byte_tokenizer import byte_tokenizer
from tests.servers import ROOT, free_port
from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import prompt, wait_kv_idle, wait_until

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]

MODEL = "tiny"
CHAT: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are terse."},
                                          {"role": "user", "content": "Hello there, 世界"}]


def grpc_text(server: HttpServer, **fields: Any) -> str:
    with grpc.insecure_channel(server.address) as ch:
        replies = list(decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(**fields), timeout=60))
    return "".join(r.text for r in replies)


def post(server: HttpServer, path: str, body: bytes, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


# --- answers --------------------------------------------------------------------------------------
def test_models_and_health(http_server: HttpServer) -> None:
    assert [m.id for m in http_server.client().models.list()] == [MODEL]
    conn = http.client.HTTPConnection("127.0.0.1", http_server.http_port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


@pytest.mark.parametrize("mode", [None, "chunked", "layered"])
def test_completion_is_grpcs_answer(http_server: HttpServer, mode: str | None) -> None:
    ids = prompt(40, salt=3)
    extra = {"ignore_eos": True, **({"prefill_mode": mode, "chunk_size": 16} if mode else {})}
    got = http_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                                  extra_body=extra)
    assert got.choices[0].text == grpc_text(http_server, token_ids=ids, max_new_tokens=12, ignore_eos=True)
    assert got.choices[0].finish_reason == "length" and got.model == MODEL
    assert got.usage is not None and (got.usage.prompt_tokens, got.usage.completion_tokens) == (40, 12)


def test_seeded_sampling_and_text_prompts_match_grpc(http_server: HttpServer) -> None:
    client = http_server.client()
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0.9, top_p=0.95, seed=1234,
                extra_body={"ignore_eos": True})
    first, again = (client.completions.create(**args).choices[0].text for _ in range(2))  # type: ignore[call-overload]
    assert first == again == grpc_text(http_server, prompt="Once upon a time", max_new_tokens=10, ignore_eos=True,
                                       sampling=decode_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=1234))


def test_numbers_beyond_float32_sample_as_over_grpc(http_server: HttpServer) -> None:
    """JSON numbers are float64; the proto's sampling fields float32. A top_p below float32's range is
    0 there, which HTTP refuses (it would keep no token); as a float64 filter it would fail the batch."""
    args: dict[str, Any] = dict(model=MODEL, prompt=prompt(12), max_tokens=6, temperature=0.7, seed=9,
                                extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match=r"top_p must be in \(0, 1\], got 1e-300"):
        http_server.client().completions.create(top_p=1e-300, **args)
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite 32-bit number"):
        http_server.client().completions.create(**{**args, "temperature": 1e39})


def test_streamed_completion_is_one_event_a_token_then_usage_and_done(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(30, salt=5)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 9 and "".join(c.choices[0].text for c in tokens) == whole
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 8 + ["length"]
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 39
    plain = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, stream=True))
    assert len(plain) == 3 and all(c.usage is None for c in plain)  # no include_usage, no usage event


def test_chat_goes_through_the_models_template(http_server: HttpServer) -> None:
    client = http_server.client()
    rendered = byte_tokenizer().render_chat(CHAT)
    expected = client.completions.create(model=MODEL, prompt=rendered, max_tokens=14, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=14, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == expected
    assert got.usage is not None and got.usage.prompt_tokens == len(byte_tokenizer().apply_chat_template(CHAT))
    stream = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=14,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(20, salt=8)
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    printable = [i for i in range(3, len(full) - 2) if full[i:i + 2].isprintable() and full[i:i + 2].strip()]
    assert printable, f"no printable stop string in {full!r}"
    stop = full[printable[0]:printable[0] + 2]
    expected = full[:full.index(stop)]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=[stop, "\x00never"],
                                    extra_body={"ignore_eos": True})
    assert (got.choices[0].text, got.choices[0].finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_kv_idle(http_server)  # the rest of the generation was let go


# --- refusals -------------------------------------------------------------------------------------
BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None, list[str]]] = [
    (dict(max_tokens=0), "max_tokens", ["max_tokens must be at least 1, got 0"]),
    (dict(max_tokens=40960), "max_tokens", ["max_tokens (40960)", "context limit of 40960"]),
    (dict(temperature=-1), "temperature", ["temperature must be a finite number >= 0"]),
    (dict(top_p=2), "top_p", ["top_p must be in (0, 1], got 2"]),
    (dict(top_p=0), "top_p", ["top_p must be in (0, 1], got 0"]),
    (dict(n=17), "n", ["n must be in [1, 17), got 17"]),
    (dict(prompt=[1, 999]), "prompt", ["token id 999 at position 1", "[0, 320)"]),
    (dict(prompt=""), "prompt", ["prompt is empty"]),
    (dict(prompt=["a", "b"]), "prompt", ["2 prompts"]),
    (dict(stop=[""]), "stop", ["1 to 64 characters"]),
    (dict(stop=["x"] * 17), "stop", ["17 strings; the limit is 16"]),
    (dict(seed=-1), "seed", ["seed must be in [0, 18446744073709551616)"]),
    (dict(logprobs=21), "logprobs", ["logprobs must be in [0, 20], got 21"]),
    (dict(stream_options={"include_usage": True}), "stream_options", ["only allowed with stream: true"]),
    (dict(extra_body={"prefill_mode": "fast"}), "prefill_mode", ["prefill_mode must be one of", "layered"]),
    (dict(extra_body={"prefill_mode": "disaggregated"}), None, ["needs a prefill server"]),
    (dict(extra_body={"chunk_size": 100}), "chunk_size", ["chunk_size must be a power of two from 16", "got 100"]),
    (dict(extra_body={"prefill_sms": -1}), "prefill_sms", ["prefill_sms must be >= 0", "got -1"]),
    (dict(extra_body={"top_k": 2**31}), "top_k", ["top_k must be in [-2147483648, 2147483648)"]),
    (dict(extra_body={"stop_token_ids": [400]}), "stop_token_ids", ["stop_token_ids[0] = 400", "[0, 320)"]),
    (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos", ["ignore_eos must be true or false, got a string"]),
    (dict(max_tokens=2.5), "max_tokens", ["max_tokens must be an integer, got a number"]),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_COMPLETIONS, ids=[w[0] for _, _, w in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400_naming_field_and_limit(http_server: HttpServer, fields: dict[str, Any],
                                                             param: str | None, words: list[str]) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": prompt(8), "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().completions.create(**args)
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["param"] == param
    assert all(w in error["message"] for w in words) and "\n" not in error["message"], error


@pytest.mark.parametrize(("messages", "words"), [
    ([], ["messages must be a non-empty array"]),
    ([{"role": "wizard", "content": "hi"}], ["messages[0].role must be one of"]),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ["array of text parts"]),
    ([{"role": "user", "content": "x " * 600_000}], ["to more than the context limit of 40960"]),
])
def test_bad_chats_are_400(http_server: HttpServer, messages: list[Any], words: list[str]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert all(w in str(caught.value) for w in words), caught.value


def test_unknown_model_is_404(http_server: HttpServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        http_server.client().completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"
    assert "'gpt-4o' does not exist" in caught.value.body["message"]


def test_malformed_and_oversized_bodies(http_server: HttpServer) -> None:
    status, body = post(http_server, "/v1/completions", b'{"prompt": "x", "max_tokens": ')
    assert status == 400 and body["error"]["code"] == "invalid_json" and "not valid JSON" in body["error"]["message"]
    status, body = post(http_server, "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "must be a JSON object, got list" in body["error"]["message"]
    status, body = post(http_server, "/v1/completions", b"\xff\xfe")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = post(http_server, "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}')
    assert status == 400 and "lone UTF-16 surrogate" in body["error"]["message"]
    # the size check comes before the body is read, so the client's claim alone is refused
    conn = http.client.HTTPConnection("127.0.0.1", http_server.http_port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str((64 << 20) + 1))
    conn.endheaders()
    response = conn.getresponse()
    refusal = json.loads(response.read())["error"]["message"]
    assert response.status == 413 and "larger than this server's limit" in refusal
    conn.close()
    status, body = post(http_server, "/v1/embeddings", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"


# --- clients that walk away -----------------------------------------------------------------------
def test_disconnects_give_the_kv_back(http_server: HttpServer) -> None:
    start = http_server.metrics()["kv_cache_free_blocks"]
    client = http_server.client()
    stream = client.completions.create(model=MODEL, prompt=prompt(64), max_tokens=5000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream, strict=False):
        pass
    assert http_server.metrics()["kv_cache_free_blocks"] < start  # it holds its blocks while it streams
    stream.close()
    wait_kv_idle(http_server, timeout=10)
    with pytest.raises(openai.APITimeoutError):  # not streamed: the client gives up while it decodes
        http_server.client(timeout=0.5).completions.create(model=MODEL, prompt=prompt(64), max_tokens=5000,
                                                           extra_body={"ignore_eos": True})
    wait_kv_idle(http_server, timeout=10)
    for _ in range(5):  # reset, not closed, while events are being written
        hang_up_hard(http_server)
    wait_kv_idle(http_server, timeout=10)
    assert http_server.metrics()["kv_cache_free_blocks"] == start
    assert "Traceback" not in http_server.own_log(), http_server.own_log()[-4000:]


def hang_up_hard(server: HttpServer, n: int = 1) -> None:
    body = json.dumps({"prompt": prompt(16), "max_tokens": 5000, "stream": True, "ignore_eos": True, "n": n}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while not all(b'"index":%d' % i in received for i in range(n)):  # every choice is streaming
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST


def test_full_pool_is_429_and_deadline_504(server_logs: Path) -> None:
    """A pool of ~4000 tokens, one waiter allowed, and a 2 s limit: the first request holds the pool and
    runs past the limit mid-stream, the second waits for blocks past it, the third finds the queue full."""
    server = HttpServer(server_logs, "--kv-cache-gb", "0.004", "--max-model-len", "4096", "--max-queued-requests", "1",
                        "--http-timeout-s", "2")
    server.start()
    try:
        client = server.client()
        args: dict[str, Any] = dict(model=MODEL, prompt=prompt(24), max_tokens=4000, extra_body={"ignore_eos": True})
        first = iter(client.completions.create(stream=True, **args))
        next(first)
        started = time.monotonic()
        waiter_error: list[BaseException] = []

        def wait_in_queue() -> None:
            try:
                client.completions.create(**args)
            except openai.APIStatusError as e:
                waiter_error.append(e)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        wait_until(lambda: server.metrics()["num_requests_waiting"] == 1, timeout=10)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(**args)
        assert "--max-queued-requests 1" in str(refused.value)
        with pytest.raises(openai.APIError) as mid_stream:  # an SSE error event: the headers were long sent
            for _ in first:
                pass
        assert "--http-timeout-s 2" in str(mid_stream.value) and time.monotonic() - started < 10
        waiter.join(30)
        assert [e.status_code for e in waiter_error] == [504]  # type: ignore[attr-defined]
        wait_kv_idle(server, timeout=10)
        assert "Traceback" not in server.own_log(), server.own_log()[-4000:]
    finally:
        server.stop()


def test_draining_server_answers_503_and_finishes_its_streams(server_logs: Path) -> None:
    server = HttpServer(server_logs, "--drain-timeout-s", "30")
    server.start()
    try:
        client = server.client()
        stream = iter(client.completions.create(model=MODEL, prompt=prompt(16), max_tokens=300, stream=True,
                                                extra_body={"ignore_eos": True}))
        next(stream)
        server.signal(signal.SIGTERM)
        wait_until(lambda: health(server) == 503, timeout=10)
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503 and "shutting down" in str(refused.value)
        assert len(list(stream)) == 299  # the stream in flight still gets every token
        assert server.wait(30) == 0
        assert "Traceback" not in server.own_log(), server.own_log()[-4000:]
    finally:
        server.kill()


def health(server: HttpServer) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_served_model_name() -> None:
    from decode_server.__main__ import parse_config, served_model_name

    assert served_model_name(parse_config(["--preset", "tiny"])[0], "tiny") == "tiny"
    assert served_model_name(parse_config(["--model", "/models/Qwen2.5-7B-Instruct/"])[0], "qwen2") == \
        "Qwen2.5-7B-Instruct"
    assert served_model_name(parse_config(["--preset", "tiny", "--served-model-name", "chat"])[0], "tiny") == "chat"


def test_busy_http_port_is_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "decode_server", "--port", str(free_port()), "--http-port",
                               str(port), "--metrics-port", "0", "--device", "cpu"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (f"error: can't listen on 127.0.0.1:{port} (Address already in "
                                                    "use); stop the other process or pass another --http-port")


# --- the load generator over both APIs ------------------------------------------------------------
def test_load_over_openai_sends_what_grpc_sends(http_server: HttpServer) -> None:
    from client.load import run_deployments

    spec = LoadSpec(rate=8, duration=1.0, prompt_len="uniform:8:48", output_len="6", seed=3)
    runs = [Deployment("grpc", (http_server.address,)), Deployment("http", (http_server.url,), api="openai")]
    grpc_run, http_run = run_event_loop(run_deployments(spec, runs, 60, warmup=True, progress=False))
    assert grpc_run.records and all(r.ok for r in grpc_run.records + http_run.records)
    sent = [[(r.key, r.prompt_len, len(r.token_times_s)) for r in run.records] for run in (grpc_run, http_run)]
    assert sent[0] == sent[1] and all(n == 6 for _, _, n in sent[0])
