"""vLLM's `/tokenize` and `/detokenize`: a prompt, or a chat through the model's template, counted
with the server's own tokenizer (how clients size a prompt against the context before sending it),
and token ids turned back into text. Read with the same checks and bounds as a generation's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decode_server.openai_body import MAX_FIELD_NAME_CHARS, Body
from decode_server.openai_options import read_chat_options
from decode_server.openai_prompt import TOKEN_ID_RANGE, check_text, read_messages
from decode_server.openai_tools import Tools, read_tools
from engine.tokenizer import ChatOptions, Tokenizer
from serving.validation import InvalidRequest

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset({"model", "messages", "tools", "add_generation_prompt", "continue_final_message",
                         "chat_template_kwargs", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str = ""                 # a prompt's text, or
    messages: list[dict[str, Any]] = field(default_factory=list)  # a chat's, for its template
    tools: Tools | None = None
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    add_special_tokens: bool = True  # a prompt's; a chat template writes its own
    token_strs: bool = False         # each token's own text too

    @property
    def chat(self) -> bool:
        return bool(self.messages)


def _refuse_unknown(data: dict[str, Any], known: frozenset[str], path: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        name = unknown[0][:MAX_FIELD_NAME_CHARS]
        raise InvalidRequest(f"{path} takes no field {name!r} (it takes {', '.join(sorted(known))})", name)


def read_tokenize(data: Any, max_items: int) -> TokenizeRequest:
    """A prompt (`prompt`) or a chat (`messages`); exactly one."""
    body = Body(data)
    if ("prompt" in body.data) == ("messages" in body.data):
        raise InvalidRequest("/tokenize takes exactly one of prompt (text) and messages (a chat)", "prompt")
    model = body.get("model", str, "a string")
    token_strs = body.flag("return_token_strs")
    if "messages" in body.data:
        _refuse_unknown(body.data, CHAT_FIELDS, "/tokenize with messages")
        return TokenizeRequest(model, messages=read_messages(body.data["messages"], max_items),
                               tools=read_tools(body.data), chat_options=read_chat_options(body),
                               token_strs=token_strs)
    _refuse_unknown(body.data, PROMPT_FIELDS, "/tokenize with a prompt")
    prompt = body.get("prompt", str, "a string")
    if not prompt:
        raise InvalidRequest("prompt is empty", "prompt")
    return TokenizeRequest(model, prompt=check_text(prompt, "prompt"),
                           add_special_tokens=body.flag("add_special_tokens", True), token_strs=token_strs)


def tokenize_reply(ids: list[int], tokenizer: Tokenizer, max_model_len: int, token_strs: bool) -> dict[str, Any]:
    """vLLM's response: the count, the context it is measured against, the ids (and their texts)."""
    strs = [tokenizer.backend.id_to_token(i) for i in ids] if token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def read_detokenize(data: Any, vocab_size: int, max_items: int) -> tuple[str | None, list[int]]:
    """(model, token ids), each id in the vocabulary."""
    body = Body(data)
    _refuse_unknown(body.data, DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens", list, "an array of token ids")
    if tokens is None:
        raise InvalidRequest("/detokenize needs tokens: an array of token ids", "tokens")
    if len(tokens) > max_items:
        raise InvalidRequest(f"tokens holds {len(tokens)} ids; at most the context limit of {max_items}", "tokens")
    low, high = TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], vocab_size)
    for position, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or not low <= token < high:
            raise InvalidRequest(f"tokens[{position}] = {str(token)[:20]} is not a token id of the vocabulary "
                                 f"[0, {vocab_size})", "tokens")
    return body.get("model", str, "a string"), tokens
