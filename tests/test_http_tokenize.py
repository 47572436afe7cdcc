"""vLLM's /tokenize and /detokenize: the ids are the ones a generation of the same prompt or chat
takes (its usage counts them), each refusal is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.byte_tokenizer import byte_tokenizer
from engine.tokenizer import ChatOptions
from tests.test_http_api import post
from tests.test_http_fixtures import HttpServer

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]


def call(server: HttpServer, path: str, **body: Any) -> tuple[int, Any]:
    return post(server, path, json.dumps(body).encode())


def test_prompt_ids_are_the_generations(http_server: HttpServer) -> None:
    status, got = call(http_server, "/tokenize", model=MODEL, prompt="Once upon a time", return_token_strs=True)
    assert status == 200, got
    tokenizer = byte_tokenizer()
    assert got["tokens"] == tokenizer.encode("Once upon a time") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 40960 and len(got["token_strs"]) == got["count"]
    whole = http_server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1)
    assert whole.usage is not None and whole.usage.prompt_tokens == got["count"]
    status, plain = call(http_server, "/tokenize", prompt="Once upon a time", add_special_tokens=False)
    assert plain["tokens"] == tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert plain["token_strs"] is None
    status, text = call(http_server, "/detokenize", model=MODEL, tokens=got["tokens"])
    assert status == 200 and text == {"prompt": "Once upon a time"}


@pytest.mark.parametrize("fields", [{}, {"add_generation_prompt": False},
                                    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_chat_ids_are_the_generations(http_server: HttpServer, fields: dict[str, Any]) -> None:
    status, got = call(http_server, "/tokenize", messages=CHAT, **fields)
    assert status == 200, got
    tokenizer = byte_tokenizer()
    options = ChatOptions(add_generation_prompt=fields.get("add_generation_prompt", True))
    assert got["tokens"] == tokenizer.encode(tokenizer.render_chat(CHAT, options=options), add_special_tokens=False)
    whole = http_server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,  # type: ignore[arg-type]
                                                         extra_body=fields)
    assert whole.usage is not None and whole.usage.prompt_tokens == got["count"]


def test_a_chat_of_many_messages_is_counted_in_the_render_pool(http_server: HttpServer) -> None:
    chat = [{"role": "user", "content": f"m{i}"} for i in range(300)]  # past the pool's 256
    status, got = call(http_server, "/tokenize", messages=chat)
    assert status == 200, got
    assert got["tokens"] == byte_tokenizer().encode(byte_tokenizer().render_chat(chat), add_special_tokens=False)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "ab " * 40000}, "prompt"),  # encodes past the context
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 320]}, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_refusals_name_the_field(http_server: HttpServer, path: str, body: dict[str, Any], param: str) -> None:
    status, got = call(http_server, path, **body)
    assert status == (404 if param == "model" else 400) and got["error"]["param"] == param, got
    assert call(http_server, "/tokenize", prompt="still serving")[0] == 200
