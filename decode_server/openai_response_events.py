"""A streamed Response's typed SSE events, in place of chat's chunks (the same calls from `Reply`):
`response.created` and `response.in_progress` first; an output item a message or function call,
each opened (`output_item.added`, and a message's `content_part.added`), added to
(`output_text.delta`, `function_call_arguments.delta`) and closed with its whole text; the handler
ends the stream with `response.completed` (or `response.incomplete`) holding the whole Response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decode_server.openai_responses import (
    ResponsesFields,
    call_item,
    event,
    message_item,
    new_id,
    response_object,
    status_of,
)


@dataclass
class _Call:
    item_id: str
    call_id: str
    name: str
    output_index: int
    arguments: str = ""


class ResponseEvents:
    index = 0  # a Response has one answer

    def __init__(self, response_id: str, created: int, model: str, echoed: ResponsesFields) -> None:
        self.response_id, self.created, self.model, self.echoed = response_id, created, model, echoed
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # closed output items, in order
        self.message: tuple[str, int] | None = None  # the open message's id and output index
        self.text = ""
        self.calls: dict[int, _Call] = {}  # chat's tool-call index -> its open item
        self.started = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = event(kind, self.sequence, **fields)
        self.sequence += 1
        return out

    def _opening(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        response = response_object(self.response_id, self.created, self.model, self.echoed, "in_progress", [], None)
        return self._event("response.created", response=response) + \
            self._event("response.in_progress", response=response)

    # --- what Reply calls ---------------------------------------------------------------------
    def token(self, text: str, finish_reason: str | None, first: bool, logprobs: str | None = None,
              usage: dict[str, int] | None = None) -> bytes:
        out = self._opening() + (self._add_text(text) if text else b"")
        return out + (self._close_all() if finish_reason else b"")

    def delta(self, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None,
              usage: dict[str, int] | None = None) -> bytes:
        out = self._opening()
        if delta.get("content"):
            out += self._add_text(delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._add_call(call)
        return out + (self._close_all() if finish_reason else b"")

    def usage(self, usage: dict[str, int]) -> bytes:
        return b""  # the Response's usage goes in response.completed

    # --- items --------------------------------------------------------------------------------
    def _next_index(self) -> int:
        return len(self.items) + (self.message is not None) + len(self.calls)

    def _open_message(self) -> bytes:
        self.message = (new_id("msg"), self._next_index())
        item_id, index = self.message
        return (self._event("response.output_item.added", output_index=index,
                            item=message_item(item_id, "", "in_progress"))
                + self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def _add_text(self, text: str) -> bytes:
        out = self._open_message() if self.message is None else b""
        assert self.message is not None
        item_id, index = self.message
        self.text += text
        return out + self._event("response.output_text.delta", item_id=item_id, output_index=index, content_index=0,
                                 delta=text, logprobs=[])

    def _add_call(self, delta: dict[str, Any]) -> bytes:
        out = b""
        arguments = delta["function"].get("arguments", "")
        if delta.get("id") is not None:  # a new call: the message before it is whole
            out += self._close_message()
            call = _Call(new_id("fc"), delta["id"], delta["function"]["name"], self._next_index())
            self.calls[delta["index"]] = call
            out += self._event("response.output_item.added", output_index=call.output_index,
                               item=call_item(call.item_id, call.call_id, call.name, "", "in_progress"))
        call = self.calls[delta["index"]]
        if arguments:
            call.arguments += arguments
            out += self._event("response.function_call_arguments.delta", item_id=call.item_id,
                               output_index=call.output_index, delta=arguments)
        return out

    def _close_message(self) -> bytes:
        if self.message is None:
            return b""
        (item_id, index), self.message = self.message, None
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        item = message_item(item_id, self.text, "completed")
        self.items.append(item)
        return (self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                            text=self.text, logprobs=[])
                + self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=index, item=item))

    def _close_all(self) -> bytes:
        out = b""
        if self.message is None and not self.calls and not self.items:
            out = self._open_message()  # an empty answer is an empty message
        out += self._close_message()
        for call in sorted(self.calls.values(), key=lambda c: c.output_index):
            item = call_item(call.item_id, call.call_id, call.name, call.arguments, "completed")
            self.items.append(item)
            out += self._event("response.function_call_arguments.done", item_id=call.item_id,
                               output_index=call.output_index, arguments=call.arguments)
            out += self._event("response.output_item.done", output_index=call.output_index, item=item)
        self.calls = {}
        return out

    def completed(self, finish_reason: str | None, usage: dict[str, int]) -> bytes:
        """The last event: the whole Response."""
        status = status_of(finish_reason)
        response = response_object(self.response_id, self.created, self.model, self.echoed, status, self.items, usage)
        return self._event("response.completed" if status == "completed" else "response.incomplete",
                           response=response)
