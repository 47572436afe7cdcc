"""Structured outputs over the OpenAI HTTP API, against a real decode server (the tiny preset: random
weights, a byte-level tokenizer built locally): each answer follows its grammar, a bad grammar is a
400 naming its field, and rows without a grammar in the same steps get the tokens they get alone."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import prompt

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}


def complete(server: HttpServer, seed: int, **fields: Any) -> tuple[str, str]:
    got = server.client().completions.create(model=MODEL, prompt=prompt(12, salt=seed), max_tokens=120,
                                             temperature=1.0, seed=seed, extra_body=fields)
    return got.choices[0].text, str(got.choices[0].finish_reason)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates(http_server: HttpServer, seed: int) -> None:
    text, finish = complete(http_server, seed, response_format={"type": "json_schema",
                                                                "json_schema": {"name": "p", "schema": SCHEMA}})
    assert finish == "stop", text
    value = json.loads(text)
    assert set(value) == {"name", "age", "ok"} and re.fullmatch("[a-z]{1,6}", value["name"])
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and isinstance(value["ok"], bool)


def test_json_object_chat_output_parses(http_server: HttpServer) -> None:
    client = http_server.client()
    got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a JSON object"}],
                                         max_tokens=200, temperature=0.7, seed=5,
                                         response_format={"type": "json_object"},
                                         logit_bias={"125": 6})  # "}": a random model closes the object soon
    text = got.choices[0].message.content or ""
    assert got.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_regex_and_choice(http_server: HttpServer) -> None:
    for seed in (1, 2):
        text, _ = complete(http_server, seed, guided_regex=r"[a-c]{2}-[0-9]{1,3}")
        assert re.fullmatch(r"[a-c]{2}-[0-9]{1,3}", text), text
        text, finish = complete(http_server, seed, structured_outputs={"choice": ["yes", "no", "maybe"]})
        assert text in ("yes", "no", "maybe") and finish == "stop", text
        text, _ = complete(http_server, seed, guided_choice=["red", "green"])
        assert text in ("red", "green"), text


def test_grammar_ends_at_max_tokens(http_server: HttpServer) -> None:
    got = http_server.client().completions.create(model=MODEL, prompt=prompt(8, salt=4), max_tokens=3, seed=1,
                                                  extra_body={"guided_regex": "x{10}"})
    assert got.choices[0].text == "xxx" and got.choices[0].finish_reason == "length"


def test_rows_without_a_grammar_keep_their_tokens(http_server: HttpServer) -> None:
    """Greedy answers without a grammar, alone and then in the same steps as rows with one."""
    client = http_server.client()

    def plain(salt: int) -> str:
        return client.completions.create(model=MODEL, prompt=prompt(16, salt=salt), max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text or ""

    alone = [plain(s) for s in (31, 32)]
    jobs: list[Any] = [lambda: plain(31), lambda: complete(http_server, 7, guided_regex="[xyz]{30}"),
                       lambda: plain(32), lambda: complete(http_server, 8, response_format={"type": "json_object"})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: job(), jobs))
    assert [mixed[0], mixed[2]] == alone
    assert re.fullmatch("[xyz]{30}", mixed[1][0]), mixed[1]


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": ["a"], "min_tokens": 3}, "min_tokens"), ({"guided_regex": "a", "min_p": 0.5}, "min_p"),
    ({"response_format": {"type": "json_object"}, "allowed_token_ids": [5]}, "allowed_token_ids"),
    ({"guided_regex": "a+", "bad_words": ["a"]}, "bad_words"),
    ({"guided_regex": "a", "prefill_mode": "disaggregated"}, "prefill_mode"),
])
def test_bad_grammars_are_400(http_server: HttpServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, extra_body=fields)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, caught.value.body
    assert "\n" not in caught.value.body["message"]


def test_grammar_rows_answer_alike_with_and_without_overlapped_steps(http_server: HttpServer,
                                                                     server_logs: Path) -> None:
    """Overlapped, a grammar row's forward is queued before the step before is read and its mask
    made after: the answers (greedy within the grammar, beside rows without one) must be the ones
    of a server that reads each step before queueing the next."""
    def answers(server: HttpServer) -> list[str]:
        client = server.client()

        def run(salt: int, fields: dict[str, Any]) -> str:
            return client.completions.create(model=MODEL, prompt=prompt(12, salt=salt), max_tokens=40, temperature=0,
                                             extra_body=fields).choices[0].text or ""

        jobs = [(41, {"guided_regex": "[a-f]{3,12}-[0-9]{2,20}"}), (42, {"ignore_eos": True}),
                (43, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
                (44, {"guided_choice": ["alpha", "beta", "gamma"]}), (45, {"ignore_eos": True})]
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda job: run(*job), jobs))

    serial = HttpServer(server_logs, "--no-overlap-steps").start()
    try:
        expected = answers(serial)
    finally:
        serial.stop()
    assert answers(http_server) == expected
    assert re.fullmatch("[a-f]{3,12}-[0-9]{2,20}", expected[0]) and expected[3] in ("alpha", "beta", "gamma")
