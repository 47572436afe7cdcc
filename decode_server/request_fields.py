"""A request's fields as a front end reads them off its wire, before any check (`RequestFields`),
the names each front end gives them, and the checks on a prompt text's length that come before it is
tokenized. `request_parser` turns the fields into a checked `Request`; the HTTP API's render worker
uses these alone, so nothing here imports torch or the engine's kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.grammar_spec import GrammarSpec
from engine.penalty_spec import Penalties
from engine.tokenizer import Tokenizer
from serving.token_ids import TokenIds
from serving.validation import InvalidRequest

MAX_STOP_TOKEN_IDS = 1024
MAX_PROMPT_CHARS_PER_TOKEN = 64   # text longer than this many characters per context token can't fit


def check_text_fits(chars: int, limit: int, what: str, field: str) -> None:
    """Refuse text too long to fit `limit` tokens before paying to tokenize it."""
    if chars > limit * MAX_PROMPT_CHARS_PER_TOKEN:
        raise InvalidRequest(f"{what} of {chars} characters can't fit the context limit of {limit} tokens (at most "
                             f"{limit * MAX_PROMPT_CHARS_PER_TOKEN} characters are accepted)", field)


def encode_within_context(tokenizer: Tokenizer, text: str, limit: int, add_special_tokens: bool, what: str,
                          field: str) -> list[int]:
    """The text's ids, or the refusal of a text that encodes to more than the context's `limit` tokens (the
    encoding stops counting there, so a huge text costs no more than a full context)."""
    ids = tokenizer.encode_within(text, limit, add_special_tokens)
    if ids is None:
        raise InvalidRequest(f"{what} of {len(text)} characters encodes to more than the context limit of "
                             f"{limit} tokens", field)
    return ids


def tokens_kept(truncate_prompt_tokens: int, limit: int) -> int:
    """How many of a prompt's last tokens vLLM's truncate_prompt_tokens keeps (-1: as many as the
    context holds); 0: all."""
    return limit if truncate_prompt_tokens < 0 else truncate_prompt_tokens


def encode_prompt(tokenizer: Tokenizer, text: str, limit: int, add_special_tokens: bool, truncate_prompt_tokens: int,
                  what: str, field: str) -> list[int]:
    """A prompt text's ids: the last ones truncate_prompt_tokens keeps, read from the text's tail (it
    may encode past the context before it is cut), or else all of them, refused past the context."""
    keep = tokens_kept(truncate_prompt_tokens, limit)
    if keep:
        return tokenizer.encode_tail(text, keep, add_special_tokens)
    return encode_within_context(tokenizer, text, limit, add_special_tokens, what, field)


@dataclass(frozen=True, kw_only=True)
class RequestFields:
    """A request before any check. As in the proto, 0 / "" / empty mean unset. Built by keyword only:
    fourteen fields of like types are too easy to swap by position."""

    request_id: str
    token_ids: TokenIds = ()          # kept as the field it came in: no per-token work on the event loop
    prompt: str = ""
    add_special_tokens: bool = True  # False for a chat template's text, which writes its own
    max_new_tokens: int | None = 0   # None: as many as fit the context, at most --default-chat-max-tokens
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int | None = None          # None: a random seed (the proto's 0 is read as None)
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    prefill_mode: int = 0            # PrefillMode.number; 0 = the server's --mode
    chunk_size: int = 0
    prefill_sms: int = 0             # partitioned: its prefill's SM count; 0 = the server's
    cache_salt: str = ""             # its prefix-cache namespace; "" = none
    truncate_prompt_tokens: int = 0  # keep the prompt's last this many tokens (-1: the context's); 0 = all
    logprobs: int | None = None      # log probabilities of the tokens and this many alternatives; None: none
    prompt_logprobs: int | None = None  # ... of the prompt's tokens, this many alternatives (echo, vLLM's field)
    prompt_ranks: bool = False          # ... and each prompt token's rank among all (vLLM's field shows it)
    penalties: Penalties | None = None
    bad_words: tuple[str, ...] = ()     # texts the answer may not produce (tokenized here, into penalties)
    grammar: GrammarSpec | None = None  # structured outputs
    grammar_field: str = ""             # the field that asked for it, as its client named it


@dataclass(frozen=True)
class FieldNames:
    """What a front end calls each field, so that a refusal names the field its client sent."""

    request_id: str = "request_id"
    prompt: str = "prompt"
    token_ids: str = "token_ids"
    max_new_tokens: str = "max_new_tokens"
    sampling: str = "sampling"       # the sampling fields' parent ("" where they stand alone)
    stop_token_ids: str = "stop_token_ids"
    prefill_mode: str = "prefill_mode"
    chunk_size: str = "chunk_size"
    prefill_sms: str = "prefill_sms"
    cache_salt: str = "cache_salt"
    logprobs: str = "logprobs"


GRPC_NAMES = FieldNames()
