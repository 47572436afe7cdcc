"""Tool calls over the OpenAI HTTP API, with the SDK, against a decode server on a tiny random Qwen2
checkpoint whose locally built tokenizer has a hermes-style chat template (as Qwen2.5's): tools are
rendered into the prompt, `tool_choice` required and named hold the answer to the tools' schema,
`auto` parses `<tool_call>` blocks, and streamed answers carry the calls as deltas."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from decode_server.openai_tools import Tools, parse_calls
from tests.conftest import write_tiny_checkpoint, write_tokenizer
from tests.test_http_fixtures import HttpServer

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS: list[Any] = [WEATHER, TIME]
ASK: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[HttpServer]:
    folder = write_tokenizer(write_tiny_checkpoint(tmp_path_factory.mktemp("tools") / MODEL, seed=5,
                                                  max_position_embeddings=2048))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": HERMES_TEMPLATE}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    server = HttpServer(server_logs, "--model", str(folder), "--max-model-len", "2048").start()
    yield server
    server.stop()


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and re.fullmatch("[A-Za-z]{1,8}", value["city"])
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


def test_named_tool_choice_calls_it(tools_server: HttpServer) -> None:
    got = tools_server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)


def test_required_tool_choice_streams_deltas(tools_server: HttpServer) -> None:
    client = tools_server.client()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, seed=4, parallel_tool_calls=False)
    calls: list[Any] | None = whole.choices[0].message.tool_calls  # type: ignore[assignment]
    assert whole.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1, whole
    assert calls[0].function.name in ("get_weather", "get_time")
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=120, seed=4, parallel_tool_calls=False, stream=True)
    deltas = [c.choices[0] for c in streamed if c.choices]
    assert deltas[-1].finish_reason == "tool_calls"
    got = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in got if c.function] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_auto_parses_hermes_tool_calls_and_passes_text(tools_server: HttpServer) -> None:
    client = tools_server.client()
    forced = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'
    got = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=1,
                                         extra_body={"guided_regex": forced})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content is None
    call: Any = choice.message.tool_calls[0]
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, seed=1,
                                           extra_body={"guided_regex": "[a-z ]{3,8}"})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    later = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=4)
    assert later.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_400(tools_server: HttpServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        tools_server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                      extra_body={"tools": TOOLS, **fields})
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, caught.value.body


def test_a_template_without_tools_refuses_them(http_server: HttpServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tools"


def test_llama3_json_parser() -> None:
    tools = Tools(TOOLS, "auto")
    content, calls = parse_calls('{"name": "get_time", "parameters": {"zone": "cet"}}', tools, "llama3_json")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": "cet"})]
    assert parse_calls("It is sunny.", tools, "llama3_json") == ("It is sunny.", [])
    assert parse_calls('{"name": "unknown", "parameters": {}}', tools, "llama3_json")[1] == []
