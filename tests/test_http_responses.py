"""OpenAI's Responses API (`/v1/responses`) with the official SDK: each request is the chat it becomes
(same text, same usage), streamed events add up to the whole Response, function calls come back as
output items (from a hermes-template checkpoint), and what the server can't honour is a 400 naming
the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.test_http_api import post
from tests.test_http_fixtures import HttpServer
from tests.test_http_tools import HERMES_TEMPLATE, TOOLS, serve_with_template
from tests.test_http_tools import MODEL as TOOLS_MODEL

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory, server_logs: Path) -> Iterator[HttpServer]:
    server = serve_with_template(tmp_path_factory.mktemp("responses") / TOOLS_MODEL, HERMES_TEMPLATE, server_logs)
    yield server
    server.stop()


def as_chat(server: HttpServer, messages: list[dict[str, Any]], model: str = MODEL, **fields: Any) -> Any:
    return server.client().chat.completions.create(model=model, messages=messages, temperature=0,  # type: ignore[arg-type]
                                                   max_completion_tokens=12, **fields)


@pytest.mark.parametrize("instructions", [None, "Answer in French."])
def test_a_response_is_the_chat_it_becomes(http_server: HttpServer, instructions: str | None) -> None:
    client = http_server.client()
    response = client.responses.create(model=MODEL, input="Hello there", instructions=instructions, **GREEDY)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat = as_chat(http_server, [*messages, {"role": "user", "content": "Hello there"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.instructions == instructions and response.model == MODEL and response.id.startswith("resp_")


def test_input_items_are_the_chats_messages(http_server: HttpServer) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                         {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "Again"}]
    response = http_server.client().responses.create(model=MODEL, input=items, **GREEDY)
    chat = as_chat(http_server, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                                 {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_response(http_server: HttpServer) -> None:
    client = http_server.client()
    whole = client.responses.create(model=MODEL, input="Tell me", metadata={"run": "7"}, **GREEDY)
    events = list(client.responses.create(model=MODEL, input="Tell me", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response  # type: ignore[union-attr]
    assert text == whole.output_text == last.output_text
    assert last.usage is not None and whole.usage is not None
    assert last.usage.output_tokens == whole.usage.output_tokens and whole.metadata == {"run": "7"}


def test_function_calls_are_output_items(tools_server: HttpServer) -> None:
    client = tools_server.client()
    tools: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    args: dict[str, Any] = dict(model=TOOLS_MODEL, input="weather in Paris?", tools=tools, max_output_tokens=60,
                                temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**args)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city", "days"}
    events = list(client.responses.create(stream=True, **args))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert arguments == calls[0].arguments and [d.type for d in done] == ["function_call"]
    # the call and its output, sent back, are the chat's assistant tool call and tool message
    follow_up: list[Any] = ["weather in Paris?", {"type": "function_call", "call_id": calls[0].call_id,
                                                  "name": "get_weather", "arguments": calls[0].arguments},
                            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    follow_up[0] = {"role": "user", "content": follow_up[0]}
    response = client.responses.create(model=TOOLS_MODEL, input=follow_up, temperature=0, max_output_tokens=12)
    chat = as_chat(tools_server, [{"role": "user", "content": "weather in Paris?"},
                                  {"role": "assistant", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                   "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                                  {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}],
                   model=TOOLS_MODEL)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage is not None and response.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": "é" * 30_000}, "input"),  # 60,000 tokens through the template: past the context
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_refusals_name_the_responses_field(http_server: HttpServer, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    assert http_server.client().responses.create(model=MODEL, input="still serving", max_output_tokens=2).output


def test_text_format_json_schema_holds_the_answer(http_server: HttpServer) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    response = http_server.client().responses.create(
        model=MODEL, input="a number", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    assert response.status == "completed" and set(json.loads(response.output_text)) == {"n"}
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_a_large_body_is_read_in_the_render_pool(http_server: HttpServer) -> None:
    """Past 256 KiB a body is read, rendered and tokenized in the render pool's process: the same
    Response as the body without its padding, and a refusal there names the Responses field."""
    body = {"model": MODEL, "input": [{"role": "user", "content": "Hello pool"}], **GREEDY}
    padded = json.dumps(body).replace(", ", "," + " " * 100_000)  # JSON whitespace, 300 KB of it
    assert len(padded) > 256 << 10
    status, got = post(http_server, "/v1/responses", padded.encode())
    assert status == 200, got
    whole = http_server.client().responses.create(**body)
    assert got["output"][0]["content"][0]["text"] == whole.output_text
    too_long = json.dumps({"model": MODEL, "input": "é" * 150_000})  # 300,000 tokens: past the context
    status, got = post(http_server, "/v1/responses", too_long.encode())
    assert status == 400 and got["error"]["param"] == "input", got
