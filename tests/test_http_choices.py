"""n > 1 over the OpenAI HTTP API, against a real decode server: n choices, each its own sampled
answer (choice i with the request's seed + i), usage counting the prompt once, and the prompt's KV
shared through the prefix cache rather than prefilled n times; streamed, the choices' events
interleaved on one stream, each its own ending, and a hang-up ending them all."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import openai
import pytest
from openai.types import Completion

from tests.test_http_api import hang_up_hard
from tests.test_http_fixtures import HttpServer, approx_logprobs
from tests.test_reliability_fixtures import prompt, wait_kv_idle

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]

MODEL = "tiny"


def hit_tokens(server: HttpServer) -> float:
    metrics = server.metrics()
    return metrics.get("prefix_cache_hit_tokens_total", metrics.get("prefix_cache_hit_tokens", 0.0))


def test_n_choices_share_the_prompt(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(64, salt=31)
    before = hit_tokens(http_server)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=1.0, seed=7, n=4,
                                    logprobs=1, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert len({c.text for c in got.choices}) > 1  # sampled apart
    assert all(c.logprobs is not None and len(c.logprobs.token_logprobs or []) == 10 for c in got.choices)
    assert got.usage is not None and (got.usage.prompt_tokens, got.usage.completion_tokens) == (64, 40)
    assert hit_tokens(http_server) - before >= 3 * 48  # the three later choices took the prompt's full blocks
    for i, choice in enumerate(got.choices):  # choice i is the request with seed 7 + i
        alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=1.0, seed=7 + i,
                                          extra_body={"ignore_eos": True})
        assert alone.choices[0].text == choice.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    wait_kv_idle(http_server)


def test_n_refusals(http_server: HttpServer) -> None:
    client = http_server.client()
    for kwargs in (dict(n=17), dict(n=0)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)  # type: ignore[call-overload]
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"


def by_choice(chunks: list[Completion]) -> dict[int, list[Any]]:
    """Each choice's streamed events, in the order they came."""
    choices: dict[int, list[Any]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            choices[choice.index].append(choice)
    return choices


def test_streamed_n_choices_are_the_unstreamed_ones(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(64, salt=37)
    args: dict[str, Any] = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=1.0, seed=11, n=3, logprobs=1,
                                extra_body={"ignore_eos": True})
    before = hit_tokens(http_server)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert hit_tokens(http_server) - before >= 2 * 48  # the two later choices took the prompt's full blocks
    whole = client.completions.create(**args)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (64, 36)
    streamed = by_choice(chunks[:-1])
    assert sorted(streamed) == [0, 1, 2] and all(len(chunk.choices) == 1 for chunk in chunks[:-1])
    order = [chunk.choices[0].index for chunk in chunks[:-1]]
    assert order != sorted(order)  # interleaved as they were decoded side by side, not one choice after another
    for choice in whole.choices:
        events = streamed[choice.index]
        assert "".join(e.text for e in events) == choice.text
        assert [e.finish_reason for e in events] == [None] * 11 + ["length"]  # each choice ends on its own
        # The two runs batch their rows differently, so float sums may round differently in the last bits.
        streamed_logprobs = [v for e in events for v in e.logprobs.token_logprobs]  # type: ignore[union-attr]
        assert streamed_logprobs == approx_logprobs(choice.logprobs.token_logprobs)  # type: ignore[union-attr]
    wait_kv_idle(http_server)


def test_streamed_greedy_choices_are_each_the_single_answer(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(40, salt=41)
    alone = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, n=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert {i: "".join(e.text for e in events) for i, events in by_choice(chunks).items()} == \
        {0: alone, 1: alone, 2: alone}
    messages: Any = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    deltas: dict[int, list[Any]] = defaultdict(list)
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2,
                                                stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            deltas[choice.index].append(choice)
    assert sorted(deltas) == [0, 1]
    for events in deltas.values():
        assert events[0].delta.role == "assistant" and events[-1].finish_reason == "length"
        assert "".join(e.delta.content or "" for e in events) == chat
    wait_kv_idle(http_server)


def test_a_hang_up_cancels_every_choice(http_server: HttpServer) -> None:
    start = http_server.metrics()["kv_cache_free_blocks"]
    stream = http_server.client().completions.create(model=MODEL, prompt=prompt(64, salt=43), max_tokens=5000, n=4,
                                                     temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    seen: set[int] = set()
    for chunk in stream:
        seen.update(choice.index for choice in chunk.choices)
        if len(seen) == 4:
            break
    assert http_server.metrics()["kv_cache_free_blocks"] < start - 4  # all four hold their blocks while they stream
    stream.close()
    wait_kv_idle(http_server, timeout=10)
    for _ in range(3):  # reset, not closed, while every choice writes its events
        hang_up_hard(http_server, n=4)
    wait_kv_idle(http_server, timeout=10)
    assert http_server.metrics()["kv_cache_free_blocks"] == start
    assert "Traceback" not in http_server.own_log(), http_server.own_log()[-4000:]
