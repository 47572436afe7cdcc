"""Large chats rendered by their template and tokenized in a separate process.

A chat template is jinja, pure Python: rendering thousands of messages holds the GIL for tenths of
a second in 5 ms slices, and every decode step, which gives the GIL up and takes it back at each
call into torch, waits up to a slice at each one meanwhile (a convoy). So a chat past a size is
rendered and tokenized by a worker process that holds its own copy of the tokenizer: this process
only pickles the messages over and takes the token ids back as one packed protobuf field. The worker starts with the
first such chat (a second or so), not with the server."""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pd.v1 import decode_pb2

from engine.tokenizer import ChatTemplateError, Tokenizer
from serving.token_ids import TokenIds

POOL_MESSAGES = 16         # chats of more messages than this ...
POOL_CHARS = 16384         # ... or of more characters are rendered in the worker
WORKERS = 1

_tokenizer: Tokenizer | None = None  # the worker's own


def _start_worker(tokenizer: Tokenizer) -> None:
    global _tokenizer
    _tokenizer = tokenizer


def _render_and_encode(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       max_tokens: int) -> tuple[bytes | None, str | None]:
    """(the ids as a serialized GenerateRequest, or None when they are surely more than `max_tokens`;
    the template's refusal, or None). The ids come back as protobuf's packed field, which this
    process reads in C in one pass, as both servers hold a prompt (`serving/token_ids.py`)."""
    assert _tokenizer is not None
    try:
        text = _tokenizer.render_chat(messages, tools)
    except ChatTemplateError as e:
        return None, str(e)
    ids = _tokenizer.encode_within(text, max_tokens, add_special_tokens=False)
    return (None if ids is None else decode_pb2.GenerateRequest(token_ids=ids).SerializeToString()), None


class ChatRenderPool:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool: ProcessPoolExecutor | None = None

    @staticmethod
    def wants(messages: list[dict[str, Any]], chars: int) -> bool:
        return len(messages) > POOL_MESSAGES or chars > POOL_CHARS

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     max_tokens: int) -> TokenIds | None:
        """The chat's prompt ids (the template writes its own BOS), or None when they are surely more
        than `max_tokens`; a template that refuses the messages raises ChatTemplateError."""
        loop = asyncio.get_running_loop()
        try:
            packed, refusal = await loop.run_in_executor(self._executor(), _render_and_encode, messages, tools,
                                                         max_tokens)
        except BrokenProcessPool:  # the worker died (killed, out of memory): the next chat starts another
            self._pool = None
            raise
        if refusal is not None:
            raise ChatTemplateError(refusal)
        return None if packed is None else decode_pb2.GenerateRequest.FromString(packed).token_ids

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fork would copy this process (the model, CUDA's state) and its threads' locks
            self._pool = ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker, initargs=(self.tokenizer,))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
