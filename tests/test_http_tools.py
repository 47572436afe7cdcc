"""Tool calls over the OpenAI HTTP API, with the SDK, against a decode server on a tiny random Qwen2
checkpoint whose locally built tokenizer has a hermes-style chat template (as Qwen2.5's): tools are
rendered into the prompt, `tool_choice` required and named hold the answer to the tools' schema,
`auto` parses `<tool_call>` blocks (and, on a second server with a Llama 3 style template, JSON
calls), and streamed answers send content and calls as they are generated, ending as the unstreamed
answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import write_tiny_checkpoint, write_tokenizer
from tests.test_http_fixtures import HttpServer, approx_logprobs

pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

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
LLAMA3_TEMPLATE = (  # Llama 3.x's way: the tools in the prompt, a call answered as {"name", "parameters"}
    "{%- if tools %}<|im_start|>system\nAnswer a call as {\"name\": ..., \"parameters\": ...}:"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ASK: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
MODEL = "tiny-qwen2"


def serve_with_template(folder: Path, template: str, server_logs: Path) -> HttpServer:
    write_tokenizer(write_tiny_checkpoint(folder, seed=5, max_position_embeddings=2048))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return HttpServer(server_logs, "--model", str(folder), "--max-model-len", "2048").start()


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[HttpServer]:
    server = serve_with_template(tmp_path_factory.mktemp("tools") / MODEL, HERMES_TEMPLATE, server_logs)
    yield server
    server.stop()


@dataclass
class Streamed:
    """A streamed chat answer with tools, as a client puts it together."""

    events: list[Any] = field(default_factory=list)  # each chunk's choice
    contents: list[str] = field(default_factory=list)  # the content deltas, in order
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # index: id, name, arguments, argument deltas

    @classmethod
    def read(cls, chunks: Iterator[Any]) -> Streamed:
        got = cls()
        for chunk in chunks:
            for choice in chunk.choices:
                got.events.append(choice)
                if choice.delta.content:
                    assert not got.calls, "content after a call"
                    got.contents.append(choice.delta.content)
                for call in choice.delta.tool_calls or []:
                    if call.id is not None:  # the first delta of a call names it
                        assert call.index not in got.calls and call.type == "function" and call.function.name
                        got.calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": "",
                                                 "deltas": 0}
                    else:
                        assert call.function.name is None
                    got.calls[call.index]["arguments"] += call.function.arguments or ""
                    got.calls[call.index]["deltas"] += 1
        return got

    def matches(self, whole: Any) -> None:
        """The same content, calls and ending as the unstreamed answer."""
        message = whole.choices[0].message
        assert ("".join(self.contents) or None) == message.content
        assert [(c["name"], c["arguments"]) for _, c in sorted(self.calls.items())] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert self.events[0].delta.role == "assistant"
        assert [e.finish_reason for e in self.events] == [None] * (len(self.events) - 1) + \
            [whole.choices[0].finish_reason]


def check_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and re.fullmatch("[A-Za-z]{1,8}", value["city"])
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


def test_named_tool_choice_calls_it(tools_server: HttpServer) -> None:
    got = tools_server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls, choice  # a forced call: OpenAI's "stop"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_weather(call.function.arguments)


def test_required_tool_choice_streams_deltas(tools_server: HttpServer) -> None:
    client = tools_server.client()
    args: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                                seed=4, parallel_tool_calls=False)
    whole = client.chat.completions.create(**args)
    calls: list[Any] | None = whole.choices[0].message.tool_calls  # type: ignore[assignment]
    assert whole.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1, whole
    assert calls[0].function.name in ("get_weather", "get_time")
    streamed = Streamed.read(client.chat.completions.create(stream=True, **args))
    streamed.matches(whole)
    assert streamed.calls[0]["deltas"] > 2  # the arguments came as they were generated, not at the end


def test_streamed_hermes_content_then_calls_as_generated(tools_server: HttpServer) -> None:
    client = tools_server.client()
    forced = (r'[a-z]{8,12} <tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'
              r'\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", "days": [1-7]\}\}'
              r'</tool_call>')
    for n in (1, 2):
        args: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=2, n=n,
                                    extra_body={"guided_regex": forced})
        whole = client.chat.completions.create(**args)
        assert whole.choices[0].message.content and len(whole.choices[0].message.tool_calls or []) == 2
        chunks = list(client.chat.completions.create(stream=True, **args))
        for i in range(n):  # each choice is the request with seed 2 + i
            alone = client.chat.completions.create(**{**args, "n": 1, "seed": 2 + i})
            streamed = Streamed.read(iter([c for c in chunks if c.choices and c.choices[0].index == i]))
            streamed.matches(alone)
            assert len(streamed.contents) > 1 and all(c["deltas"] > 2 for c in streamed.calls.values())
    plain = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, seed=1,
                 extra_body={"guided_regex": "[a-z ]{10,12}"})
    text = Streamed.read(client.chat.completions.create(stream=True, **plain))  # type: ignore[call-overload]
    text.matches(client.chat.completions.create(**plain))  # type: ignore[call-overload]
    assert len(text.contents) > 1 and not text.calls  # text without calls streams as it comes


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


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[HttpServer]:
    server = serve_with_template(tmp_path_factory.mktemp("llama3") / MODEL, LLAMA3_TEMPLATE, server_logs)
    yield server
    server.stop()


def test_streamed_llama3_json_calls(llama3_server: HttpServer) -> None:
    client = llama3_server.client()
    forced = (r'\{"name": "get_time", "parameters": \{"zone": "(utc|cet)"\}\}; '
              r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{2,6}", "days": [1-7]\}\}')
    for guided, calls in ((forced, 2), ("[a-z ]{10,12}", 0)):
        args: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, seed=3, logprobs=True,
                                    extra_body={"guided_regex": guided})
        whole = client.chat.completions.create(**args)
        assert len(whole.choices[0].message.tool_calls or []) == calls
        streamed = Streamed.read(client.chat.completions.create(stream=True, **args))
        streamed.matches(whole)
        logprobs = whole.choices[0].logprobs.content or []  # type: ignore[union-attr]
        assert whole.usage is not None and len(logprobs) == whole.usage.completion_tokens  # every token's, streamed
        assert [lp.logprob for e in streamed.events if e.logprobs for lp in e.logprobs.content or []] == \
            approx_logprobs([lp.logprob for lp in logprobs])
        assert all(c["deltas"] > 2 for c in streamed.calls.values()) and (calls or len(streamed.contents) > 1)
