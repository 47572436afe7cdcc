"""A streamed OpenAI answer's SSE events, built from JSON fragments made once a request: per token only
its text (and, when asked, its log probabilities) is encoded."""

from __future__ import annotations

import json
from typing import Any, Protocol


class EventFormat(Protocol):
    """How a choice's streamed events are written: chat's and completions' chunks (`ChunkFormat`), or
    the Responses API's typed events (`openai_response_events.ResponseEvents`)."""

    index: int

    def token(self, text: str, finish_reason: str | None, first: bool, logprobs: str | None = None,
              usage: dict[str, int] | None = None) -> bytes: ...

    def delta(self, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None,
              usage: dict[str, int] | None = None) -> bytes: ...

    def usage(self, usage: dict[str, int]) -> bytes: ...


class ChunkFormat:
    """A request's SSE events, from JSON fragments made once: per token only its text is encoded."""

    def __init__(self, request_id: str, chat: bool, created: int, model: str, index: int = 0) -> None:
        self.request_id, self.model, self.created, self.index = request_id, model, created, index
        obj = "chat.completion.chunk" if chat else "text_completion"
        common = (f'data: {{"id":{json.dumps(request_id)},"object":"{obj}","created":{created},'
                  f'"model":{json.dumps(model)},')
        self.usage_head = common + '"choices":[],"usage":'
        choice = common + f'"choices":[{{"index":{index},'
        self.first = choice + ('"delta":{"role":"assistant","content":' if chat else '"text":')
        self.head = choice + ('"delta":{"content":' if chat else '"text":')
        self.close = "}" if chat else ""
        self.finish = {reason: f',"finish_reason":{json.dumps(reason)}}}]}}\n\n' for reason in (None, "stop", "length")}
        self.tails = {reason: f'{self.close},"logprobs":null{finish}' for reason, finish in self.finish.items()}

    def token(self, text: str, finish_reason: str | None, first: bool, logprobs: str | None = None,
              usage: dict[str, int] | None = None) -> bytes:
        """One token's event; `logprobs`: its log probabilities' JSON, when the request asked; `usage`:
        its choice's so far (vLLM's continuous_usage_stats)."""
        head = (self.first if first else self.head) + json.dumps(text)
        if logprobs is None:
            event = head + self.tails[finish_reason]
        else:
            event = head + self.close + ',"logprobs":' + logprobs + self.finish[finish_reason]
        if usage is not None:  # into the chunk's object, after its choices
            event = event[:-len("}\n\n")] + ',"usage":' + json.dumps(usage) + "}\n\n"
        return event.encode()

    def usage(self, usage: dict[str, int]) -> bytes:
        return (self.usage_head + json.dumps(usage) + "}\n\n").encode()

    def delta(self, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None,
              usage: dict[str, int] | None = None) -> bytes:
        """A chat event of any delta (tool calls), encoded whole."""
        chunk = {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason}], **({"usage": usage} if usage is not None else {})}
        return f"data: {json.dumps(chunk)}\n\n".encode()
