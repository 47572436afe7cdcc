"""Each row's next token from the logits the model gave: its penalties and filters, then its grammar's
mask (both on a copy: `engine.penalties`, `engine.grammar`), then sampling. The log probabilities a row
asks for are of the raw logits, as vLLM returns them. A decode step and a local prefill's first token
both sample here."""

from __future__ import annotations

import torch

from decode_server.sequence import RequestSequence
from engine import grammar, penalties
from engine.logprobs import StepLogprobs, device_tensor
from engine.sampling import sample


def sample_rows(logits: torch.Tensor, seqs: list[RequestSequence], produced: list[int], device: torch.device,
                greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, StepLogprobs | None]:
    """`logits` [B, V], one row a sequence; `produced[i]`: row i's answer tokens so far. `greedy`, a
    decode step's fused argmax of the raw logits, is recomputed for the rows a penalty or mask changed.
    Returns the tokens (on the device) and the queued log probabilities of the rows that ask."""
    vocab = logits.shape[-1]  # (a row without penalties or a grammar costs no call here: 64 rows a step)
    states = [s.penalties_on(vocab, device) if s.penalties is not None else None for s in seqs]
    penalised = any(state is not None for state in states)
    adjusted, changed = (penalties.apply(logits, states, [s.params.temperature for s in seqs], produced)
                         if penalised else (logits, []))
    grammars = [s.grammar_on() if s.grammar is not None else None for s in seqs]
    if any(g is not None for g in grammars):  # masks a copy: the log probabilities are of the raw logits
        adjusted = adjusted if changed else adjusted.clone()
        changed = sorted(set(changed) | set(grammar.apply(adjusted, grammars)))
    if changed and greedy is not None:  # the fused argmax is of the logits before the penalties and masks
        rows = device_tensor(changed, torch.long, greedy.device)
        greedy = greedy.index_copy(0, rows, adjusted.index_select(0, rows).argmax(dim=-1).to(greedy.dtype))
    tokens = sample(adjusted, [s.params for s in seqs], produced, greedy)
    if penalised:
        penalties.count(states, tokens)
    return tokens, StepLogprobs.queue(logits, tokens, [s.logprobs for s in seqs])
