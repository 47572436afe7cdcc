"""Structured outputs through xgrammar: a request's grammar (a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar) is compiled once per distinct grammar (xgrammar's compiler caches
them) off the event loop; each sequence with one holds a matcher, which masks the tokens that can't
continue it. The mask is applied to a step's logits of the rows that have a grammar, on the device,
and the matcher takes each token once it is read back, on the engine's thread. A step where no row
has a grammar does nothing here."""

from __future__ import annotations

import functools

import torch
import xgrammar as xgr

from engine.grammar_spec import GrammarError, GrammarSpec
from engine.logprobs import device_tensor
from engine.tokenizer import Tokenizer

CompiledGrammar = xgr.CompiledGrammar
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
    """One sequence's matcher (engine thread only)."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: list[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)

    def accept(self, token: int) -> bool:
        """Advances with a sampled token; True once the grammar has ended (its stop token taken)."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)
        return bool(self.matcher.is_terminated())


@functools.cache
def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """xgrammar's pool for filling several rows' masks at once (half the host's hardware threads).
    A mask can take hundreds of microseconds (a JSON string's state after arbitrary bytes, measured
    on the CPU), so eight rows one after another held the engine thread for a millisecond a step."""
    return xgr.BatchGrammarMatcher()


def apply(logits: torch.Tensor, states: list[GrammarState | None]) -> list[int]:
    """Masks, in place, the rows of `logits` that have a grammar to the tokens that can continue it;
    returns those rows. The mask is filled on the host from the matchers (which have taken every
    token so far) and copied to the device without a wait, the rows' indices too: given as a list,
    xgrammar copies them from pageable memory, which waits for the stream, the step's forward
    queued just before among its work."""
    live = [(i, s.matcher) for i, s in enumerate(states) if s is not None and not s.matcher.is_terminated()]
    if not live:
        return []
    rows, matchers = [i for i, _ in live], [m for _, m in live]
    vocab = logits.shape[-1]
    cuda = logits.device.type == "cuda"
    # xgr.allocate_token_bitmask's mask, pinned from the start on CUDA (not copied into pinned memory)
    mask = torch.full(xgr.get_bitmask_shape(len(states), vocab), -1, dtype=xgr.bitmask_dtype, pin_memory=cuda)
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(mask, rows[0])
    else:  # the rows' masks side by side on xgrammar's threads, in one call that gives up the GIL once
        _batch_matcher().batch_fill_next_token_bitmask(matchers, mask, rows)
    if cuda:
        index = device_tensor(rows, torch.int32, logits.device)  # typed a list; its CUDA kernels take a tensor
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), vocab_size=vocab,
                                        indices=index)  # type: ignore[arg-type]
    else:
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=rows)
    return rows
