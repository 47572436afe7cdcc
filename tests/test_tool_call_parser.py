"""The streamed tool-call parser on its own (no server): for hermes, Llama 3 JSON, `required` and a named
function, what it sends as a piece comes is what the whole answer parses to, however the answer is cut
into pieces; content and a call's name go out as soon as they are decided, arguments as they come, and
only an undecided tail waits."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_server.openai_tool_calls import CallDelta, ToolCallParser, parse_calls
from decode_server.openai_tools import Tools
from tests.test_http_tools import TIME, TOOLS

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
          '<tool_call>{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; '
         '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}')
REQUIRED = '[{"name":"get_time","parameters":{"zone":"utc"}},{"name":"get_weather","parameters":{"city":"X","days":1}}]'
CASES: list[tuple[Tools, str | None, str]] = [
    (Tools(TOOLS, "auto"), "hermes", HERMES),
    (Tools(TOOLS, "auto", parallel=False), "hermes", HERMES),
    (Tools(TOOLS, "auto"), "hermes", ' Sunny.  <tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool>'),
    (Tools(TOOLS, "auto"), "hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}'),
    (Tools(TOOLS, "auto"), "hermes", '<tool_call>{"name": "get_time", "arguments": "utc, please"}'),  # no JSON inside
    (Tools(TOOLS, "auto"), "hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a\nb", "days": 1}}'),
    (Tools(TOOLS, "auto"), "hermes", '<tool_call>{"name": "get_time", "arguments": {"zo'),
    (Tools(TOOLS, "auto"), "llama3_json", LLAMA),
    (Tools(TOOLS, "auto"), "llama3_json", '  {"name": "unknown", "parameters": {}}'),
    (Tools(TOOLS, "auto"), "llama3_json", "It is sunny; {not a call}"),
    (Tools(TOOLS, "required"), "hermes", REQUIRED),
    (Tools(TOOLS, "get_weather", named=True), "hermes", '{"city":"Paris","days":3}'),
]


def streamed(tools: Tools, family: str | None, pieces: list[str]) -> tuple[str, list[CallDelta], ToolCallParser]:
    parser = ToolCallParser(tools, family)
    content, deltas = "", list[CallDelta]()
    for piece in pieces:
        out = parser.feed(piece)
        content, deltas = content + out.content, deltas + out.deltas
    out = parser.end()
    return content + out.content, deltas + out.deltas, parser


def without_ids(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("tools", "family", "text"), CASES)
def test_streamed_calls_are_the_whole_answers(tools: Tools, family: str | None, text: str) -> None:
    want_content, want_calls = parse_calls(text, tools, family)
    rng = random.Random(0)
    cuts = [sorted(rng.sample(range(len(text)), 5)) for _ in range(20)]
    for pieces in [list(text), [text], *[[text[a:b] for a, b in zip([0, *c], [*c, len(text)], strict=True)]
                                         for c in cuts]]:
        content, deltas, parser = streamed(tools, family, pieces)
        if want_calls:
            assert content == (want_content or "") and without_ids(parser.calls(deltas)) == without_ids(want_calls)
            assert [d.index for d in deltas if d.id is not None] == list(range(len(want_calls)))
        elif not parser.started:  # no call began: the answer was content, as it came
            assert content == text
    for call in want_calls:
        json.loads(call["function"]["arguments"])  # strict JSON, as a client parses it


def test_hermes_content_name_and_arguments_go_out_as_decided() -> None:
    parser = ToolCallParser(Tools(TOOLS, "auto"), "hermes")
    assert parser.feed("Let me check.").content == "Let me check."
    assert parser.feed(" <tool").content == ""  # maybe a tag, and the space before it: held back
    out = parser.feed('_call>{"name": "get_ti')
    assert out.content == "" and out.deltas == []
    first = parser.feed('me", "arguments": {"zo').deltas  # the first delta names it, with the arguments so far
    assert len(first) == 1 and (first[0].index, first[0].name, first[0].arguments) == (0, "get_time", '{"zo')
    assert first[0].id is not None and first[0].id.startswith("call_")
    assert [(d.id, d.arguments) for d in parser.feed('ne": "utc').deltas] == [(None, 'ne": "utc')]
    assert [d.arguments for d in parser.feed('"}}</tool_call>').deltas] == ['"}']
    assert parser.whole == {0} and parser.end().content == ""
    content, calls = parse_calls('Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}'
                                 '</tool_call>', Tools(TOOLS, "auto"), "hermes")
    assert content == "Let me check." and without_ids(calls) == [("get_time", '{"zone": "utc"}')]


def test_a_false_tag_and_plain_llama_text_go_out_at_once() -> None:
    parser = ToolCallParser(Tools(TOOLS, "auto"), "hermes")
    assert parser.feed("a <tool").content == "a"
    assert parser.feed("box").content == " <toolbox"
    llama = ToolCallParser(Tools(TOOLS, "auto"), "llama3_json")
    assert llama.feed("  ").content == "" and llama.feed("It").content == "  It"
    named = ToolCallParser(Tools([TIME], "get_time", named=True), None)
    out = named.feed('{"zone"')
    assert [(d.name, d.arguments) for d in out.deltas] == [("get_time", ""), (None, '{"zone"')]


def test_llama3_json_parser() -> None:
    tools = Tools(TOOLS, "auto")
    content, calls = parse_calls('{"name": "get_time", "parameters": {"zone": "cet"}}', tools, "llama3_json")
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": "cet"})]
    assert parse_calls("It is sunny.", tools, "llama3_json") == ("It is sunny.", [])
    assert parse_calls('{"name": "unknown", "parameters": {}}', tools, "llama3_json")[1] == []


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":", ",", ";",
             " ", "\n", '"name"', '"arguments"', '"parameters"', '"get_time"', '"get_weather"', '"zone"', '"utc"',
             "1", "-2.5e3", "true", "null", "abc", "é"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40), case=st.sampled_from(range(4)),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_text_streams_as_it_parses_whole(parts: list[str], case: int, cuts: list[int]) -> None:
    """Text made of the parsers' own tokens, cut anywhere: no error, and the streamed calls are the
    whole answer's (as are its content, where it held a call). Arguments are passed on as they come, so
    they are JSON where the model wrote JSON (a grammar makes it, for `required` and a named function)."""
    tools, family = [(Tools(TOOLS, "auto"), "hermes"), (Tools(TOOLS, "auto"), "llama3_json"),
                     (Tools(TOOLS, "required"), "hermes"), (Tools(TOOLS, "get_time", named=True), "hermes")][case]
    text = "".join(parts)
    edges = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(edges, edges[1:], strict=False)] or [text]
    want_content, want_calls = parse_calls(text, tools, family)
    content, deltas, parser = streamed(tools, family, pieces)
    if want_calls:
        assert without_ids(parser.calls(deltas)) == without_ids(want_calls)
        assert content == (want_content or "")
