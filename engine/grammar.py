"""Structured outputs through xgrammar: a request's grammar (a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar) is compiled once per distinct grammar (xgrammar's compiler caches
them) off the event loop; each sequence with one holds a matcher, which masks the tokens that can't
continue it. The mask is applied to a step's logits of the rows that have a grammar, on the device,
and the matchers take a step's tokens once they are read back, on the engine's thread. A step where no row
has a grammar does nothing here."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.tokenizer import Tokenizer

CompiledGrammar = xgr.CompiledGrammar
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """The grammar does not compile: a bad schema, regex or EBNF."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to follow; `text`: the schema (JSON), regex, EBNF, or the
    choices as a JSON array."""

    kind: str
    text: str = ""

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    def ebnf(self) -> str:
        """A choice's grammar: one string literal per choice (JSON escapes are EBNF's)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.text))


class GrammarCompiler:
    """The model's vocabulary as xgrammar sees it, and its compiled grammars (cached by xgrammar)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Blocking (from a worker thread): raises GrammarError for one that does not compile."""
        c = self._compiler
        try:
            # compact JSON: a model that would pad it with whitespace can't run on to max_tokens doing so
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.text, strict_mode=False, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "choice":
                return c.compile_grammar(spec.ebnf())
            if spec.kind == "grammar":
                return c.compile_grammar(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's report of a bad grammar: its parser's line
            raise GrammarError(str(e).strip().splitlines()[-1][:300]) from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")


class GrammarState:
    """One sequence's matcher (engine thread only); `taken`: how many of its tokens it has taken."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.taken = 0

    def accept(self, token: int) -> bool:
        """Advances with a sampled token; True once the grammar has ended (its stop token taken)."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)
        self.taken += 1
        return bool(self.matcher.is_terminated())


def take(states: list[GrammarState], tokens: list[int]) -> None:
    """Each matcher takes its row's token, all in one call into xgrammar: each call gives the GIL up,
    and while the event loop streams tokens, getting it back can cost up to a switch interval."""
    live = [(s.matcher, t) for s, t in zip(states, tokens, strict=True) if not s.matcher.is_terminated()]
    if live:
        xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in live], [t for _, t in live])
    for state in states:
        state.taken += 1


def apply(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor | None:
    """Masks, in place, the rows of `logits` whose grammar has not ended to the tokens that can
    continue it; returns a [B] bool tensor on the logits' device that marks them (None: no such row).

    The matchers (which have taken every token so far) fill the masks on the host, in one buffer with
    the rows' indices and flags, which goes to the device in one copy: every call into torch gives
    the GIL up (see `take`). On CUDA the buffer is pinned, so the copy is queued behind the step's
    forward without waiting for it, and torch's pinned allocator hands the buffer out again only
    once that copy is done. Rows without a grammar are left unfilled: the kernel reads the listed
    rows only."""
    rows = [i for i, s in enumerate(states) if s is not None and not s.matcher.is_terminated()]
    if not rows:
        return None
    batch, vocab = len(states), logits.shape[-1]
    words = xgr.get_bitmask_shape(1, vocab)[1]
    size = batch * words
    host = torch.empty(size + batch + len(rows), dtype=xgr.bitmask_dtype, pin_memory=logits.device.type == "cuda")
    buf = host.numpy()
    masks = buf[:size].reshape(batch, words)
    for row in rows:
        state = states[row]
        assert state is not None
        state.matcher.fill_next_token_bitmask(masks, row)
    flags, index = buf[size:size + batch], buf[size + batch:]
    flags[:] = 0
    flags[rows] = 1
    index[:] = rows
    device = host.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, device[:size].view(batch, words), vocab_size=vocab,
                                    indices=device[size + batch:])  # type: ignore[arg-type]
    return device[size:size + batch].bool()
