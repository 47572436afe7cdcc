"""The grammar rows of a step, on the CPU: `engine.grammar.apply` masks exactly the rows whose grammar
is still open, as xgrammar's own per-row masks would; `grammar.take` advances the matchers as one
`accept` a row would, and a sequence's own append then does not take the token again; `sample_rows`
leaves the rows without a grammar with the step's greedy tokens as given, and the log probabilities
of the raw logits."""

from __future__ import annotations

import torch
import xgrammar as xgr

from decode_server.config import PrefillMode
from decode_server.row_sampling import sample_rows
from decode_server.sequence import RequestSequence
from engine import grammar
from engine.byte_tokenizer import byte_tokenizer
from engine.grammar import GrammarCompiler, GrammarSpec, GrammarState
from engine.sampling import SamplingParams

VOCAB = 400  # the byte-level tokenizer's 320 ids and some padding, as a model's vocabulary has
EOS = 2


def compiled(regex: str) -> xgr.CompiledGrammar:
    return GrammarCompiler(byte_tokenizer(), VOCAB, [EOS]).compile(GrammarSpec("regex", regex))


def ids(text: str) -> list[int]:
    return byte_tokenizer().encode(text, add_special_tokens=False)


def reference_mask(state: GrammarState) -> torch.Tensor:
    """The [VOCAB] bool of the tokens the matcher allows, from xgrammar's own mask of one row."""
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    state.matcher.fill_next_token_bitmask(mask, 0)
    logits = torch.zeros(1, VOCAB)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=VOCAB)
    return logits[0] == 0


def test_apply_masks_only_the_open_grammar_rows() -> None:
    states: list[GrammarState | None] = [None, GrammarState(compiled("ab+"), [EOS]), None,
                                         GrammarState(compiled("[0-9]{2}"), [EOS]), GrammarState(compiled("a"), [EOS])]
    ended = states[4]
    assert ended is not None
    ended.accept(ids("a")[0])
    ended.accept(EOS)  # its grammar has ended: its row is left as it is
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    allowed = {row: reference_mask(s) for row, s in enumerate(states) if s is not None and row != 4}
    flags = grammar.apply(logits, states)
    assert flags is not None and flags.tolist() == [False, True, False, True, False]
    for row in (0, 2, 4):
        assert torch.equal(logits[row], raw[row])
    for row, mask in allowed.items():
        assert 0 < int(mask.sum()) < VOCAB
        assert torch.equal(logits[row][mask], raw[row][mask])
        assert bool(torch.isinf(logits[row][~mask]).all())
    assert grammar.apply(logits, [None, None]) is None


def test_take_advances_the_matchers_as_accept_does() -> None:
    one_by_one = [GrammarState(compiled("ab+c"), [EOS]) for _ in range(3)]
    batched = [GrammarState(compiled("ab+c"), [EOS]) for _ in range(3)]
    for token in [*ids("abbc"), EOS]:
        for state in one_by_one:
            state.accept(token)
        grammar.take(batched, [token] * 3)
        for a, b in zip(one_by_one, batched, strict=True):
            assert a.taken == b.taken
            assert a.matcher.is_terminated() == b.matcher.is_terminated()
            if not a.matcher.is_terminated():
                assert torch.equal(reference_mask(a), reference_mask(b))
    assert all(s.matcher.is_terminated() for s in batched)
    grammar.take(batched, [EOS] * 3)  # an ended matcher takes nothing more, and counts the token
    assert [s.taken for s in batched] == [6, 6, 6]


def sequence(regex: str | None, logprobs: int | None = None) -> RequestSequence:
    return RequestSequence("r", [5, 6, 7], 16, SamplingParams(), frozenset(), frozenset({EOS}), PrefillMode.COLOCATED,
                           16, logprobs=logprobs, grammar=compiled(regex) if regex else None)


def test_append_does_not_take_a_token_the_step_took() -> None:
    seq = sequence("ab+")
    state = seq.grammar_on()
    assert state is not None
    a, b = ids("ab")
    grammar.take([state], [a])
    seq.append(a, 0.0, 0.0)
    assert state.taken == 1
    seq.append(b, 0.0, 0.0)  # not taken by a step: the sequence's own append takes it
    assert state.taken == 2 and state.matcher.accept_token(b)  # "ab" then "b" again: still in the grammar


def test_sample_rows_keeps_the_free_rows_greedy_tokens_and_raw_logprobs() -> None:
    seqs = [sequence(None), sequence("[0-9]+"), sequence(None, logprobs=0), sequence("x", logprobs=0)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    given = torch.tensor([11, 12, 13, 14])  # not the argmax: the free rows must keep it as given
    tokens, logprobs = sample_rows(logits, seqs, [0, 0, 0, 0], torch.device("cpu"), given)
    assert tokens[0] == 11 and tokens[2] == 13
    for row, text in ((1, "0123456789"), (3, "x")):
        state = seqs[row].grammar_state
        assert state is not None
        mask = reference_mask(state)
        assert tokens[row] == int(torch.where(mask, raw[row], -torch.inf).argmax())
        assert byte_tokenizer().decode([int(tokens[row])]) in text
    assert torch.equal(logits, raw)  # a row wants log probabilities: the mask went on a copy
    assert logprobs is not None
    read = logprobs.read(4)
    for row in (2, 3):
        got = read[row]
        assert got is not None
        assert abs(got.logprob - float(torch.log_softmax(raw[row], -1)[tokens[row]])) < 1e-5
