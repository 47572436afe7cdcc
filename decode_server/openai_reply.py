"""One accepted OpenAI request's answer: each choice's tokens turned into text (stop strings, log
probabilities, echo, tool calls), sent as SSE events on the response's one stream as they come, or
gathered into one JSON body at the end."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing, suppress
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from decode_server.core import Generation
from decode_server.http_request import ApiError
from decode_server.openai_events import EventFormat
from decode_server.openai_logprobs import LogprobFormat
from decode_server.openai_schema import ApiRequest
from decode_server.openai_tool_calls import ToolCallParser, parse_calls
from decode_server.openai_tools import family_of
from engine.tokenizer import StopMatcher, StreamDetokenizer, Tokenizer
from serving.token_ids import TokenIds, as_array

FINISH_REASON = {"length": "length", "eos": "stop", "stop": "stop"}  # ours -> OpenAI's
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


@dataclass
class Answer:
    """What a choice produced: its text, token count and OpenAI finish reason."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    chars: int = 0  # of text produced so far, streamed or not


class SseStream:
    """A response's SSE stream, shared by its choices. Its headers go out with the first event, so a
    refusal before any token (a full KV pool, a failed prefill) is still a plain HTTP status; the
    choices' events are written one at a time, whole."""

    def __init__(self, request: web.Request, closing: bytes = DONE) -> None:
        """`closing`: the stream's last bytes (the Responses API's streams end with an event, not [DONE])."""
        self.request, self.closing = request, closing
        self.response: web.StreamResponse | None = None
        self._lock = asyncio.Lock()

    async def write(self, event: bytes) -> None:
        async with self._lock:
            if self.response is None:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(self.request)
                self.response = response
            await self.response.write(event)

    async def end(self, last: bytes = b"") -> web.StreamResponse:
        """`last` (the usage event, when asked for), then [DONE]."""
        await self.write(last + self.closing)
        assert self.response is not None
        await self.response.write_eof()
        return self.response

    async def fail(self, error: ApiError) -> web.StreamResponse:
        """The request's error: its HTTP status before the stream began, an SSE event after."""
        if self.response is None:
            return error.response()
        with suppress(ConnectionError):  # the client is gone too; there is no one left to tell
            await self.end(f"data: {json.dumps(error.body())}\n\n".encode())
        return self.response


class Reply:
    """One choice of an accepted request: its tokens as SSE events on `stream`, or its answer for
    the JSON body when `stream` is None."""

    def __init__(self, api: ApiRequest, fmt: EventFormat, tokenizer: Tokenizer | None,
                 stream: SseStream | None) -> None:
        self.api, self.fmt, self.tokenizer, self.stream = api, fmt, tokenizer, stream
        out = api.output
        self.detok = StreamDetokenizer(tokenizer, out.skip_special_tokens) if tokenizer is not None else None
        self.stops = StopMatcher(api.stop, out.include_stop) if api.stop else None
        self.logprobs = LogprobFormat(tokenizer, api.chat, out.tokens_as_ids) if api.fields.logprobs is not None \
            else None
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, filled with the first token
        family = family_of(tokenizer.chat_template if tokenizer is not None else "") if api.tools else None
        # streamed with tools: content and calls go out as the parser decides them
        self.tool_calls = ToolCallParser(api.tools, family) if api.tools is not None and stream is not None else None
        self.family = family
        self.first_token = asyncio.Event()  # set once the first token is in
        self.sent = False  # an event of this choice went out (the first carries the role)

    async def collect(self, generation: Generation) -> Answer:
        """Its tokens, streamed as they come when asked to be, and what they made."""
        answer = Answer()
        seq = generation.seq
        async with aclosing(generation.run()) as tokens:
            async for out in tokens:
                self.first_token.set()
                echoed, logprobs_from = "", 0
                if self.api.echo and out.index == 0 and self.api.chat:  # vLLM's: the answer continues it
                    echoed = answer.text = self.api.echo_text
                elif self.api.echo and out.index == 0:  # the prompt's log probabilities are in by its first token
                    echoed = answer.text = self._prompt_text(seq.prompt)
                    answer.chars = len(answer.text)
                    if self.logprobs is not None:
                        logprobs_from = len(self.logprobs.entries)
                        asked = self.api.fields.logprobs or 0  # prompt_logprobs may have asked for more
                        self.logprobs.add_prompt(as_array(seq.prompt).tolist(),
                                                 [replace(lp, top=lp.top[:asked]) for lp in seq.prompt_logprob_values])
                if self.api.prompt_logprobs is not None and out.index == 0:
                    self.prompt_logprobs = LogprobFormat(self.tokenizer, self.api.chat,
                                                         self.api.output.tokens_as_ids).vllm_prompt(
                        as_array(seq.prompt).tolist(), seq.prompt_logprob_values, self.api.prompt_logprobs)
                piece = self.detok.step(out.token_id) if self.detok is not None else ""
                answer.tokens += 1
                finish = FINISH_REASON.get(out.finish_reason)
                if self.stops is not None:
                    piece, stopped = self.stops.feed(piece)
                    if stopped:
                        finish = "stop"
                    elif finish:
                        piece += self.stops.flush()
                logprobs = None
                if self.logprobs is not None and out.logprobs is not None:
                    logprobs = self.logprobs.add(out.token_id, out.logprobs, answer.chars)
                    if echoed and not self.api.chat:  # the first event carries the prompt's too, as vLLM streams
                        logprobs = self.logprobs.streamed(logprobs_from)
                answer.chars += len(piece)
                usage = self._usage_so_far(len(seq.prompt), answer.tokens)
                if self.tool_calls is not None:
                    finish = await self._send_tool_calls(piece, finish, logprobs, usage)
                elif self.stream is not None:
                    await self._send(echoed + piece, finish, logprobs, usage)
                else:
                    answer.text += piece
                if finish:
                    answer.finish_reason = finish
                    break
        return answer

    def _prompt_text(self, prompt: TokenIds) -> str:
        """The prompt as sent; its ids decoded where they were sent, or where truncate_prompt_tokens cut it."""
        if self.api.fields.prompt and not self.api.fields.truncate_prompt_tokens:
            return self.api.fields.prompt
        return self.tokenizer.decode(as_array(prompt).tolist()) if self.tokenizer is not None else ""

    def _usage_so_far(self, prompt_tokens: int, tokens: int) -> dict[str, int] | None:
        """vLLM's continuous_usage_stats: a streamed event's usage, its choice's tokens so far."""
        if not self.api.continuous_usage:
            return None
        return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}

    async def _send(self, piece: str, finish: str | None, logprobs: dict[str, Any] | None,
                    usage: dict[str, int] | None) -> None:
        assert self.stream is not None
        first, self.sent = not self.sent, True
        encoded = None if logprobs is None else json.dumps(logprobs)
        await self.stream.write(self.fmt.token(piece, finish, first, encoded, usage))

    def choice(self, answer: Answer) -> dict[str, Any]:
        """The answer as a non-streamed response's choice."""
        choice: dict[str, Any] = {"index": self.fmt.index, "logprobs": self.logprobs.whole() if self.logprobs else None,
                                  "finish_reason": answer.finish_reason}
        if self.api.chat:
            content, calls = self._tool_calls(answer)
            choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choice["finish_reason"] = "tool_calls" if calls and not self._forced_function else answer.finish_reason
        else:
            choice["text"] = answer.text
            if self.prompt_logprobs is not None:  # vLLM's; a chat's go in the response, beside its choices
                choice["prompt_logprobs"] = self.prompt_logprobs
        return choice

    @property
    def _forced_function(self) -> bool:
        """`tool_choice` named a function: its call ends with `stop`, as OpenAI's and vLLM's do."""
        return self.api.tools is not None and self.api.tools.named

    def _tool_calls(self, answer: Answer) -> tuple[str | None, list[dict[str, Any]]]:
        return parse_calls(answer.text, self.api.tools, self.family) if self.api.tools else (answer.text, [])

    async def _send_tool_calls(self, piece: str, finish: str | None, logprobs: dict[str, Any] | None,
                               usage: dict[str, int] | None) -> str | None:
        """A token of an answer with tools: the content and call deltas it decided, each an event (the
        first with the token's log probabilities), the last with the finish reason, `tool_calls` when
        a call was whole (but of a named function); returns that reason."""
        assert self.tool_calls is not None and self.stream is not None
        out = self.tool_calls.feed(piece)
        if finish:
            rest = self.tool_calls.end()
            out.content += rest.content
            out.deltas += rest.deltas
            finish = "tool_calls" if self.tool_calls.whole and not self._forced_function else finish
        deltas: list[dict[str, Any]] = [{"content": out.content}] if out.content else []
        deltas += [{"tool_calls": [d.openai()]} for d in out.deltas]
        if not deltas and (finish or logprobs is not None):
            deltas = [{"content": ""} if logprobs is not None else {}]
        for n, delta in enumerate(deltas):
            if not self.sent:
                delta, self.sent = {"role": "assistant", **delta}, True
            await self.stream.write(self.fmt.delta(delta, finish if n == len(deltas) - 1 else None,
                                                   logprobs if n == 0 else None, usage))
        return finish
