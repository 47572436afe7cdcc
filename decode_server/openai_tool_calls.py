"""Tool calls read from an answer as it is generated, by the parser of the chat template's family
(hermes' `<tool_call>{"name", "arguments"}</tool_call>`, Llama 3.x's `{"name", "parameters"}` split
by `;`), or from the JSON that `tool_choice` `required` (an array of calls) or a named function (its
arguments) holds the answer to. What is decided goes out at once: content as content, a call's first
delta (index, id, name) as soon as its name is whole, then its arguments' JSON text as it comes. Only
an undecided tail is held back: what may be the start of a `<tool_call>` tag, whitespace that would
end the content if a call follows, a call's text until its name says whether it is one. A whole
answer is read the same way (`parse_calls`), so a streamed answer's calls are the unstreamed ones."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from decode_server.openai_tools import LLAMA_PYTHON_TAG, Tools

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # hermes' and Llama 3's name for them
WHITESPACE = " \t\n\r"
# where each mode goes once a call's JSON is whole
AFTER_CALL = {"hermes": "close", "llama3_json": "separator", "required": "next", "named": "drop"}


@dataclass
class CallDelta:
    """A piece of a streamed call: the first one names it (id, name), the rest add to its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class JsonCall:
    """One call's JSON object, {"name": ..., "arguments" or "parameters": ...}, read a piece at a time;
    or, given `name`, the arguments' JSON value alone. `name` is set once its string is whole; the
    arguments' text gathers for `take` (raw control characters in its strings escaped, which xgrammar's
    JSON may hold and a client's strict parser refuses; arguments sent as a string are that string)."""

    def __init__(self, name: str | None = None) -> None:
        self.name, self.value_only = name, name is not None
        self.state = "value0" if self.value_only else "start"
        self.key = ARGUMENT_KEYS[0] if self.value_only else ""
        self.raw: list[str] = []  # the key or value being read
        self.kind = ""  # the value's: '"' a string, "{" an object or array, "s" a number or literal
        self.depth, self.in_string, self.escape = 0, False, False
        self.collecting = self.has_arguments = False
        self.pending: list[str] = []
        self.done = self.invalid = False

    def feed(self, text: str) -> int:
        """Reads `text` up to the object's end; how many characters of it were the call's."""
        for i, ch in enumerate(text):
            self._step(ch)
            if self.done or self.invalid:
                return i + 1
        return len(text)

    def take(self) -> str:
        text, self.pending = "".join(self.pending), []
        return text

    def _step(self, ch: str) -> None:
        state = self.state
        if state in ("start", "key0", "colon", "value0", "after") and ch in WHITESPACE:
            return
        if state == "start":
            self._expect(ch == "{", "key0")
        elif state == "key0":
            if ch == "}":
                self._close()
            else:
                self._expect(ch == '"', "key")
                self.raw, self.escape = ['"'], False
        elif state == "key":
            self.raw.append(ch)
            if self._string_ends(ch):
                key = _loads("".join(self.raw))
                self.key, self.state, self.invalid = str(key), "colon", not isinstance(key, str)
        elif state == "colon":
            self._expect(ch == ":", "value0")
        elif state == "value0":
            self._start_value(ch)
        elif state == "value":
            self._value_char(ch)
        elif ch == ",":  # after a value
            self.state = "key0"
        elif ch == "}":
            self._close()
        else:
            self.invalid = True

    def _expect(self, ok: bool, state: str) -> None:
        self.state = state
        self.invalid = self.invalid or not ok

    def _string_ends(self, ch: str) -> bool:
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            return True
        return False

    def _start_value(self, ch: str) -> None:
        kind = '"' if ch == '"' else "{" if ch in "{[" else "s" if ch in "-0123456789tfn" else ""
        if not kind:
            self.invalid = True
            return
        self.kind, self.raw, self.state = kind, [ch], "value"
        self.depth, self.in_string, self.escape = 1, kind == '"', False
        self.collecting = self.key in ARGUMENT_KEYS and not self.has_arguments
        self.has_arguments = self.has_arguments or self.collecting
        if self.collecting and kind != '"':
            self.pending.append(ch)

    def _value_char(self, ch: str) -> None:
        if self.kind == "s" and (ch in WHITESPACE or ch in ",}]"):
            self._end_value()
            if not self.done:
                self._step(ch)
            return
        self.raw.append(ch)
        inside, ends = self.in_string, False
        if self.in_string:
            self.in_string = not self._string_ends(ch)
            ends = self.kind == '"' and not self.in_string
        elif self.kind == "{":
            self.in_string = ch == '"'
            self.depth += 1 if ch in "{[" else -1 if ch in "}]" else 0
            ends = self.depth == 0
        if self.collecting and self.kind != '"':
            self.pending.append(json.dumps(ch)[1:-1] if inside and ch < " " else ch)
        if ends:
            self._end_value()

    def _end_value(self) -> None:
        self.state = "after"
        if self.key == "name" and self.name is None:
            name = _loads("".join(self.raw))
            self.invalid, self.name = not isinstance(name, str), name if isinstance(name, str) else None
        elif self.collecting and self.kind == '"':  # arguments sent as a string: that string is their JSON,
            text = str(_loads("".join(self.raw)))      # or, where it holds none, a JSON string of it
            self.pending.append(text if _is_json(text) else json.dumps(text))
        self.collecting = False
        if self.value_only:
            self.done = True

    def _close(self) -> None:
        if self.name is None:
            self.invalid = True
            return
        if not self.has_arguments:
            self.pending.append("{}")
        self.done = True


@dataclass
class Output:
    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)


class ToolCallParser:
    """An answer's content and tool calls, a piece at a time (`feed`, then `end`)."""

    def __init__(self, tools: Tools, family: str | None) -> None:
        self.tools = tools
        self.known = {t["function"]["name"] for t in tools.tools}
        self.mode = "named" if tools.named else "required" if tools.choice == "required" else family or "plain"
        self.state = {"hermes": "text", "llama3_json": "start", "required": "array", "named": "call"}.get(
            self.mode, "plain")
        self.buffer = ""
        self.space = ""  # hermes: whitespace at the content's end, dropped if a call follows
        self.block = ""  # a possible call's text, content again if it turns out to be none
        self.call: JsonCall | None = None
        self.decision: str | None = None  # the current call's: "send", "skip" (past the first, not parallel)
        self.started = 0  # calls whose first delta went out
        self.whole: set[int] = set()  # those whose JSON was whole
        self.out = Output()
        if self.mode == "named":
            self.call, self.decision = JsonCall(tools.choice), "send"
            self._send_first()

    def feed(self, text: str) -> Output:
        self.buffer += text
        while self.buffer and self._advance():
            pass
        out, self.out = self.out, Output()
        return out

    def end(self) -> Output:
        """What was held back once the answer is whole: text that turned out to be content."""
        if self.state in ("text", "literal"):
            self._content(self.buffer)
        elif self.state in ("plain", "start"):
            self.out.content += self.buffer
        elif self.state in ("open", "call") and self.decision is None and not self.started:
            if self.mode == "hermes":
                self._content(self.block + self.buffer)
            else:
                self._plain(self.block)
        if self.mode == "hermes" and not self.started:
            self.out.content += self.space  # no call: the content is the text as it came
        self.buffer = self.space = ""
        out, self.out = self.out, Output()
        return out

    def calls(self, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """The whole calls among `deltas` (all of an answer's), in OpenAI's non-streamed shape."""
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            calls[d.index]["function"]["arguments"] += d.arguments
        return [call for i, call in sorted(calls.items()) if i in self.whole]

    # --- the states ----------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Reads what the current state can decide; False when it needs more text."""
        state, buffer = self.state, self.buffer
        if state == "plain":
            self._plain("")
        elif state == "drop":
            self.buffer = ""
        elif state in ("text", "literal", "close"):  # hermes: before a tag, in a block that is text, after a call
            tag = HERMES_OPEN if state == "text" else HERMES_CLOSE
            at = buffer.find(tag)
            if at < 0:
                keep = next((n for n in range(min(len(tag) - 1, len(buffer)), 0, -1) if tag.startswith(buffer[-n:])), 0)
                if state != "close":
                    self._content(buffer[:len(buffer) - keep])
                self.buffer = buffer[len(buffer) - keep:]
                return False
            if state == "literal":
                self._content(buffer[:at + len(tag)])
            elif state == "text":
                self._content(buffer[:at])
                self.block = tag
            self.buffer, self.state = buffer[at + len(tag):], "open" if state == "text" else "text"
        elif state == "start":  # llama3_json: a call if, after whitespace and <|python_tag|>, a `{` comes
            rest = buffer.lstrip()
            if rest.startswith(LLAMA_PYTHON_TAG):
                rest = rest[len(LLAMA_PYTHON_TAG):].lstrip()
            elif LLAMA_PYTHON_TAG.startswith(rest):
                return False
            if not rest:
                return False
            self.block, self.buffer = buffer[:len(buffer) - len(rest)], rest
            self.state = "open" if rest[0] == "{" else "plain"
            if self.state == "plain":
                self.buffer = buffer
        elif state in ("open", "array", "element", "separator", "next"):  # whitespace, then one character decides
            rest = buffer.lstrip(WHITESPACE)
            if state == "open":
                self.block += buffer[:len(buffer) - len(rest)]
            self.buffer = rest
            if not rest:
                return False
            wanted = {"open": "{", "array": "[", "element": "{", "separator": ";", "next": ","}[state]
            if rest[0] != wanted and state == "open":
                self._reject()
            elif rest[0] != wanted:
                self._drop()
            elif state in ("open", "element"):
                self.call, self.decision, self.state = JsonCall(), None, "call"
            else:
                self.buffer, self.state = rest[1:], {"array": "element", "separator": "open", "next": "element"}[state]
                self.block = ""
        else:
            self._read_call()
        return True

    def _read_call(self) -> None:
        call = self.call
        assert call is not None
        used = call.feed(self.buffer)
        self.block += self.buffer[:used]
        self.buffer = self.buffer[used:]
        if call.invalid:
            self._reject()
            return
        if self.decision is None and call.name is not None:
            if call.name not in self.known:
                self._reject()
                return
            self.decision = "send" if self.tools.parallel or not self.started else "skip"
            if self.decision == "send":
                self._send_first()
        if self.decision == "send" and (arguments := call.take()):
            self.out.deltas.append(CallDelta(self.started - 1, arguments))
        if call.done:
            if self.decision == "send":
                self.whole.add(self.started - 1)
            self.state, self.block = AFTER_CALL[self.mode], ""

    def _send_first(self) -> None:
        assert self.call is not None and self.call.name is not None
        self.out.deltas.append(CallDelta(self.started, self.call.take(), f"call_{uuid.uuid4().hex[:24]}",
                                         self.call.name))
        self.started += 1

    def _reject(self) -> None:
        """What looked like a call is none: text, while no call went out before it."""
        if self.started or self.mode not in ("hermes", "llama3_json"):
            self._drop()
        elif self.mode == "hermes":
            self._content(self.block)
            self.state = "literal"
        else:
            self._plain(self.block)
        self.block, self.decision = "", None

    def _drop(self) -> None:
        self.state = "close" if self.mode == "hermes" else "drop"

    def _plain(self, held: str) -> None:
        """The rest of the answer is content as it comes (Llama 3: it did not start with a call)."""
        self.out.content += held + self.buffer
        self.buffer, self.state = "", "plain"

    def _content(self, text: str) -> None:
        """hermes: text before the first call is content, but for whitespace at its end, which waits for
        what follows it (dropped before a call); text after a call is dropped."""
        if self.started:
            return
        text = self.space + text
        kept = text.rstrip()
        self.out.content += kept
        self.space = text[len(kept):]


def parse_calls(text: str, tools: Tools, family: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content (None when it is all tool calls) and its whole tool calls in OpenAI's
    shape; an answer without any is its text."""
    parser = ToolCallParser(tools, family)
    first, last = parser.feed(text), parser.end()
    calls = parser.calls(first.deltas + last.deltas)
    return ((first.content + last.content) or None, calls) if calls else (text, [])


def _loads(text: str) -> Any:
    try:  # not strict: xgrammar's JSON strings may hold raw control characters
        return json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
