"""From a request's fields, as any front end read them off its wire, to a checked `Request`: the one
place where the decode server's validation rules live (gRPC's `pd.v1.Decode` and the OpenAI HTTP
API both come through here). A refusal raises InvalidRequest naming the field as that front end
calls it, and the limit it broke."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from decode_server.config import DecodeConfig, PrefillMode, chunk_size_problem
from decode_server.core import Request
from decode_server.request_fields import (
    GRPC_NAMES,
    MAX_STOP_TOKEN_IDS,
    FieldNames,
    RequestFields,
    check_text_fits,
    encode_prompt,
    tokens_kept,
)
from engine.grammar import CompiledGrammar, GrammarCompiler
from engine.grammar_spec import GrammarError, GrammarSpec
from engine.penalty_spec import Penalties
from engine.sampling import SamplingError, SamplingParams
from engine.tokenizer import Tokenizer
from serving.token_ids import TokenIds, token_ids
from serving.validation import InvalidRequest, check_cache_salt, check_lengths, check_max_new_tokens, check_token_ids

MAX_REQUEST_ID_CHARS = 256
TOKENIZE_IN_THREAD_CHARS = 16384  # longer prompts are tokenized off the event loop
LOGPROB_MODES = (PrefillMode.COLOCATED, PrefillMode.CHUNKED, PrefillMode.LAYERED)


class RequestParser:
    def __init__(self, cfg: DecodeConfig, tokenizer: Tokenizer | None, max_model_len: int, vocab_size: int,
                 check_prefill_sms: Callable[[int], str | None]) -> None:
        """`check_prefill_sms`: why a partitioned request's SM count can't be had, None if it can."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.check_prefill_sms = check_prefill_sms
        self._grammars: GrammarCompiler | None = None  # made at the first grammar: reading the vocabulary takes a while
        self._grammars_made = asyncio.Lock()

    async def parse(self, f: RequestFields, arrival: float, names: FieldNames = GRPC_NAMES) -> Request:
        """Cheap checks first, so an oversized request is refused before any per-token work."""
        limit, vocab = self.max_model_len, self.vocab_size
        if len(f.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"{names.request_id} is {len(f.request_id)} characters; the limit is "
                                 f"{MAX_REQUEST_ID_CHARS}", names.request_id)
        check_cache_salt(f.cache_salt, names.cache_salt)
        has_text, has_ids = bool(f.prompt), len(f.token_ids) > 0
        if has_text == has_ids:
            raise InvalidRequest(f"set exactly one of {names.prompt} (text) and {names.token_ids}, not both"
                                 if has_text else f"the request has no prompt: set {names.prompt} (text) or "
                                                  f"{names.token_ids}", names.prompt)
        if f.max_new_tokens is not None:
            check_max_new_tokens(f.max_new_tokens, names.max_new_tokens)
        tokens = f.token_ids if has_ids else await self.encode_text(f, names)
        keep = tokens_kept(f.truncate_prompt_tokens, limit)
        if 0 < keep < len(tokens):
            tokens = token_ids(tokens[-keep:])
        max_new = f.max_new_tokens
        if max_new is None:
            max_new = min(self.cfg.default_chat_max_tokens, limit - len(tokens))
            if max_new < 1:
                raise InvalidRequest(f"the prompt ({len(tokens)} tokens) fills the context limit of {limit} "
                                     "tokens; no room is left for output", names.prompt)
        check_lengths(len(tokens), max_new, limit, names.max_new_tokens)
        check_token_ids(tokens, vocab, names.token_ids if has_ids else names.prompt)
        if len(f.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"{len(f.stop_token_ids)} {names.stop_token_ids}; the limit is {MAX_STOP_TOKEN_IDS}",
                                 names.stop_token_ids)
        for position, token in enumerate(f.stop_token_ids):
            if not 0 <= token < vocab:
                raise InvalidRequest(f"{names.stop_token_ids}[{position}] = {token} is outside the vocabulary "
                                     f"[0, {vocab})", names.stop_token_ids)
        seed = f.seed if f.seed is not None else random.getrandbits(62)
        try:
            params = SamplingParams(f.temperature, f.top_p, f.top_k, seed)
        except SamplingError as e:
            param = f"{names.sampling}.{e.field}" if names.sampling else e.field
            raise InvalidRequest(f"bad sampling parameters: {e}", param) from e
        mode = PrefillMode.from_number(f.prefill_mode) if f.prefill_mode else self.cfg.default_mode
        if mode is None:
            raise InvalidRequest(f"unknown {names.prefill_mode} {f.prefill_mode}; use one of "
                                 f"0-{max(m.number for m in PrefillMode)}", names.prefill_mode)
        if f.prompt_logprobs is not None and mode == PrefillMode.LAYERED:
            if f.prefill_mode:  # its slices yield the last token's logits alone
                raise InvalidRequest(f"the prompt's log probabilities need {names.prefill_mode} colocated or "
                                     "chunked", names.prefill_mode)
            mode = PrefillMode.COLOCATED
        if f.bad_words:
            f = replace(f, penalties=replace(f.penalties or Penalties(), bad_words=self._bad_words(f.bad_words)))
        sampled_here = (f.logprobs is not None or f.prompt_logprobs is not None or f.penalties is not None
                        or f.grammar is not None)
        if sampled_here and mode not in LOGPROB_MODES:
            # the first token's logits are only here when the prompt is prefilled here, by the engine's thread
            if f.prefill_mode:
                what = (names.logprobs if f.logprobs is not None else "prompt_logprobs" if f.prompt_logprobs is not None
                        else "penalties and logit filters" if f.penalties is not None else f.grammar_field)
                raise InvalidRequest(f"{what} need the prompt prefilled on this server: use "
                                     f"{names.prefill_mode} colocated, chunked or layered", names.prefill_mode)
            mode = PrefillMode.COLOCATED
        if f.penalties is not None:
            for token, _ in f.penalties.logit_bias:
                if not 0 <= token < vocab:
                    raise InvalidRequest(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})",
                                         "logit_bias")
            for token in f.penalties.allowed:
                if not 0 <= token < vocab:
                    raise InvalidRequest(f"allowed_token_ids names token {token}, outside the vocabulary [0, {vocab})",
                                         "allowed_token_ids")
            if f.penalties.min_tokens > max_new:
                raise InvalidRequest(f"min_tokens ({f.penalties.min_tokens}) is more than max_tokens ({max_new})",
                                     "min_tokens")
        if f.grammar is not None and f.ignore_eos:
            raise InvalidRequest(f"{f.grammar_field} ends its answer with an end token, which ignore_eos bans; "
                                 "leave one out", "ignore_eos")
        if f.grammar is not None and f.penalties is not None:  # filters that with a grammar could leave no token
            p = f.penalties
            clash = ("min_tokens" if p.min_tokens else "min_p" if p.min_p else "allowed_token_ids" if p.allowed
                     else "bad_words" if p.bad_words else "")
            if clash:
                raise InvalidRequest(f"{clash} can't be combined with {f.grammar_field}: together they may leave "
                                     "no token to sample; leave one out", clash)
        problem = chunk_size_problem(f.chunk_size) if f.chunk_size else None
        if problem:
            raise InvalidRequest(f"{names.chunk_size} {problem}; or 0 for the server's --chunk-size", names.chunk_size)
        if f.prefill_sms < 0:
            raise InvalidRequest(f"{names.prefill_sms} must be >= 0 (0 = the server's --prefill-sms), got "
                                 f"{f.prefill_sms}", names.prefill_sms)
        if mode == PrefillMode.PARTITIONED and f.prefill_sms:
            problem = self.check_prefill_sms(f.prefill_sms)
            if problem:
                raise InvalidRequest(f"{names.prefill_sms} {problem}", names.prefill_sms)
        return Request(f.request_id, tokens, max_new, params, frozenset(f.stop_token_ids), f.ignore_eos, mode,
                       f.chunk_size or self.cfg.chunk_size, arrival, f.prefill_sms, cache_salt=f.cache_salt,
                       logprobs=f.logprobs, prompt_logprobs=f.prompt_logprobs, prompt_ranks=f.prompt_ranks,
                       penalties=f.penalties,
                       grammar=await self._compile(f.grammar, f.grammar_field) if f.grammar is not None else None)

    def _bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens as it would start the text and, where the tokenizer writes a word after a
        space as other tokens of the same count, as it would follow a space (vLLM's reading)."""
        if self.tokenizer is None:
            raise InvalidRequest("bad_words needs the model's tokenizer to find the words' tokens, and this "
                                 "server's model has none; use logit_bias with token ids", "bad_words")
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if alone:
                found[alone] = None
            if spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
                found[spaced] = None
        return tuple(found)

    async def _compile(self, spec: GrammarSpec, name: str) -> CompiledGrammar:
        """The grammar compiled off the event loop (a repeated one comes from xgrammar's cache)."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{name} needs the model's tokenizer to map the grammar onto its tokens, and this "
                                 "server's model has none", name)
        async with self._grammars_made:
            if self._grammars is None:
                tokenizer, vocab = self.tokenizer, self.vocab_size
                try:
                    self._grammars = await asyncio.to_thread(
                        GrammarCompiler, tokenizer, vocab, list(tokenizer.eos_token_ids))
                except Exception as e:  # xgrammar can't read this tokenizer's vocabulary
                    raise InvalidRequest(f"{name} is not supported with this model's tokenizer ({e})", name) from e
        grammars = self._grammars
        try:
            return await asyncio.to_thread(grammars.compile, spec)
        except GrammarError as e:
            raise InvalidRequest(f"{name} is not a valid {spec.kind.replace('_', ' ')}: {e}", name) from None

    async def encode_text(self, f: RequestFields, names: FieldNames) -> TokenIds:
        """`f.prompt`'s ids (`encode_prompt`), off the event loop where the text is long."""
        if self.tokenizer is None:
            raise InvalidRequest(f"this server's model has no tokenizer, so it can't take {names.prompt} text; "
                                 f"send {names.token_ids}", names.prompt)
        limit, tokenizer = self.max_model_len, self.tokenizer
        check_text_fits(len(f.prompt), limit, f"{names.prompt} text", names.prompt)
        encode = partial(encode_prompt, tokenizer, f.prompt, limit, f.add_special_tokens, f.truncate_prompt_tokens,
                         f"{names.prompt} text", names.prompt)
        ids = await asyncio.to_thread(encode) if len(f.prompt) > TOKENIZE_IN_THREAD_CHARS else encode()
        tokens = token_ids(ids)
        if not tokens:
            raise InvalidRequest(f"the {names.prompt} text encodes to no tokens", names.prompt)
        return tokens
