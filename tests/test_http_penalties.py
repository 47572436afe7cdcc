"""Penalties and logit filters over the OpenAI HTTP API, against a real decode server, each request's
greedy answer checked against the tiny model's logits computed here with the penalty applied as
vLLM defines it; several such requests run at once, beside one without, so that they share steps."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import torch

from engine.byte_tokenizer import byte_tokenizer
from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import prompt

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"
STEPS = 8


def reference(ids: list[int], steps: int, device: str, presence: float = 0.0, frequency: float = 0.0,
              repetition: float = 1.0, bias: dict[int, float] | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens under the penalties, and each one's raw log probability, from whole prefills here
    on the server's device (where the preset's random weights were drawn)."""
    from engine.offline import make_runner

    runner = make_runner(preset="tiny", device=device, max_model_len=256)
    tokens: list[int] = []
    raw: list[float] = []
    for _ in range(steps):
        seq = ids + tokens
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(seq)))
        try:
            logits = runner.prefill(seq, table, 0).float().cpu()  # the arithmetic below is on the host
        finally:
            runner.pool.allocator.free(table)
        x = logits.clone()
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(x)).float() if tokens \
            else torch.zeros_like(x)
        seen = counts > 0
        seen[torch.tensor(ids)] = True
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0).float()
        for token, value in (bias or {}).items():
            x[token] += value
        token = int(x.argmax())
        tokens.append(token)
        raw.append(float(torch.log_softmax(logits, -1)[token]))
    return tokens, raw


CASES: list[dict[str, Any]] = [
    {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8},
    {"logit_bias": {"65": 8.0, "66": -100}}, {"frequency_penalty": -1.0, "repetition_penalty": 0.7},
]


def expected(ids: list[int], case: dict[str, Any], device: str) -> list[float]:
    _, raw = reference(ids, STEPS, device, case.get("presence_penalty", 0.0), case.get("frequency_penalty", 0.0),
                       case.get("repetition_penalty", 1.0),
                       {int(k): v for k, v in case.get("logit_bias", {}).items()})
    return raw


def answer(server: HttpServer, ids: list[int], case: dict[str, Any]) -> list[float]:
    """The raw log probabilities of the server's tokens: equal to the reference's only if the tokens are."""
    got = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=STEPS, temperature=0, logprobs=0,
                                             extra_body={"ignore_eos": True, **case})
    lp = got.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    return [float(v) for v in lp.token_logprobs]


def test_penalties_in_one_batch_are_each_the_models(http_server: HttpServer) -> None:
    ids = prompt(24, salt=21)
    plain: list[dict[str, Any]] = [{}]
    with ThreadPoolExecutor(len(CASES) + 1) as pool:
        got = list(pool.map(lambda case: answer(http_server, ids, case), CASES + plain))
    for case, values in zip(CASES + plain, got, strict=True):
        assert values == pytest.approx(expected(ids, case, http_server.device), abs=1e-3), case
    # the penalties changed answers, beyond rounding (a frequency or presence penalty alone changes
    # nothing while the greedy answer repeats no token, as here; repetition and bias do)
    assert any(values != pytest.approx(got[-1], abs=1e-3) for values in got[:-1])


def test_logit_bias_min_tokens_and_min_p(http_server: HttpServer) -> None:
    client = http_server.client()
    ids = prompt(16, salt=22)
    forced = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, logit_bias={"65": 100})
    assert forced.choices[0].text == "AAAAA"
    eos = byte_tokenizer().eos_token_ids[0]
    ended = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, logit_bias={str(eos): 100},
                                      extra_body={"min_tokens": 3})
    assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
    assert ended.usage.completion_tokens == 4  # 3 before the end token, then it
    greedy = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    only_best = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=1.0, seed=4,
                                          extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text
    assert only_best == greedy  # min_p 1 keeps the likeliest token alone
    allowed = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=1.0, seed=2,
                                        extra_body={"ignore_eos": True, "allowed_token_ids": [97, 98, 99]})
    assert set(allowed.choices[0].text) <= set("abc") and len(allowed.choices[0].text) == 12
    only_end = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=1.0, seed=2,
                                         extra_body={"allowed_token_ids": [eos], "min_tokens": 3})
    assert only_end.usage is not None and only_end.usage.completion_tokens == 1  # nothing else could come


@pytest.mark.parametrize(("fields", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_tokens": 9}, "min_tokens"),
    ({"logit_bias": {"999": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"allowed_token_ids": [1, 400]}, "allowed_token_ids"),
    ({"presence_penalty": 1, "prefill_mode": "disaggregated"}, "prefill_mode"),
])
def test_bad_penalties_are_400(http_server: HttpServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, extra_body=fields)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, caught.value.body
    assert "\n" not in caught.value.body["message"]


def greedy_tokens(server: HttpServer, ids: list[int], extra: dict[str, Any]) -> list[str]:
    got = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0, logprobs=0,
                                             extra_body={"ignore_eos": True, **extra})
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    return lp.tokens


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it(http_server: HttpServer) -> None:
    def letter(token: str) -> bool:
        return len(token) == 1 and token.isascii() and token.isalnum()  # one byte, one token

    for salt in range(30, 60):  # a prompt whose greedy answer has two letters in a row, after its start
        ids = prompt(16, salt=salt)
        plain = greedy_tokens(http_server, ids, {})
        k = next((i for i in range(1, len(plain) - 1) if letter(plain[i]) and letter(plain[i + 1])), None)
        if k is not None:
            break
    assert k is not None
    word = plain[k] + plain[k + 1]  # its first place in the answer is k: an earlier one would be found first
    banned = greedy_tokens(http_server, ids, {"bad_words": [word]})
    assert banned[:k + 1] == plain[:k + 1] and banned[k + 1] != plain[k + 1], (plain, banned)
    assert all(a + b != word for a, b in zip(banned, banned[1:], strict=False))
    single = greedy_tokens(http_server, ids, {"bad_words": [plain[k]]})
    assert single[:k] == plain[:k] and plain[k] not in single, (plain, single)
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=4, extra_body={"bad_words": [""]})
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "bad_words"
