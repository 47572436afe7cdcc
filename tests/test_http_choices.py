"""n > 1 over the OpenAI HTTP API, against a real decode server: n choices, each its own sampled
answer (choice i with the request's seed + i), usage counting the prompt once, and the prompt's KV
shared through the prefix cache rather than prefilled n times."""

from __future__ import annotations

import openai
import pytest

from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import prompt, wait_kv_idle

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
    for kwargs in (dict(n=17), dict(n=0), dict(n=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)  # type: ignore[call-overload]
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "n"
