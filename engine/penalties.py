"""Penalties and logit filters of the rows that ask for them, applied to a step's logits on the device
(no host sync) before sampling, all such rows in the same few batched ops; rows without them are
left alone and a step where no row has any computes nothing here. As vLLM: presence and frequency
penalties count the answer's tokens, the repetition penalty the prompt's and the answer's (divides a
positive logit, multiplies a negative one), `logit_bias` adds to a token's logit, `min_tokens` bans
the end tokens until that many were produced, `min_p` drops tokens less likely than that share of the
likeliest one (at the request's temperature), `allowed_token_ids` keeps those tokens alone, and
`bad_words` bans the last token of each banned sequence wherever the answer's last tokens are the
rest of it (a one-token word always). The answer's last tokens stay on the device, so that match is
a few batched comparisons with no host sync."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.logprobs import device_tensor
from engine.penalty_spec import Penalties
from engine.sampling import GREEDY_BELOW_TEMPERATURE


@dataclass
class PenaltyState:
    """One sequence's penalties on the device: its answer's token counts, its prompt's tokens, its
    bias and its banned-until-min_tokens tokens, each [V]."""

    penalties: Penalties
    counts: torch.Tensor
    in_prompt: torch.Tensor
    bias: torch.Tensor               # logit_bias, -inf outside allowed_token_ids and on one-token bad words
    ban: torch.Tensor
    words: BadWords | None = None    # the bad words of more than one token

    @classmethod
    def create(cls, penalties: Penalties, prompt: np.ndarray, end_ids: list[int], vocab: int,
               device: torch.device) -> PenaltyState:
        counts = torch.zeros(vocab, device=device)
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        in_prompt[device_tensor(prompt, torch.long, device)] = True
        bias = torch.zeros(vocab, device=device)
        if penalties.logit_bias:
            ids, values = zip(*penalties.logit_bias, strict=True)
            bias[device_tensor(ids, torch.long, device)] = device_tensor(values, torch.float32, device)
        if penalties.allowed:
            outside = torch.ones(vocab, dtype=torch.bool, device=device)
            outside[device_tensor(penalties.allowed, torch.long, device)] = False
            bias.masked_fill_(outside, float("-inf"))
        single = [w[0] for w in penalties.bad_words if len(w) == 1]
        if single:
            bias[device_tensor(single, torch.long, device)] = float("-inf")
        ban = torch.zeros(vocab, dtype=torch.bool, device=device)
        if end_ids:
            ban[device_tensor(end_ids, torch.long, device)] = True
        longer = [w for w in penalties.bad_words if len(w) > 1]
        return cls(penalties, counts, in_prompt, bias, ban, BadWords.create(longer, device) if longer else None)


@dataclass
class BadWords:
    """A sequence's bad words of n > 1 tokens, right-aligned: each word's first n - 1 tokens
    (`prefix`, with `care` false where a shorter word has nothing), its last token (`last`), and the
    answer's last `prefix.shape[1]` tokens (`recent`, -1 before the answer has that many)."""

    prefix: torch.Tensor  # [W, L]
    care: torch.Tensor    # [W, L]
    last: torch.Tensor    # [W]
    recent: torch.Tensor  # [L]

    @classmethod
    def create(cls, words: list[tuple[int, ...]], device: torch.device) -> BadWords:
        width = max(len(w) for w in words) - 1
        prefix = np.full((len(words), width), -1, dtype=np.int64)
        care = np.zeros((len(words), width), dtype=bool)
        for i, w in enumerate(words):
            prefix[i, width - len(w) + 1:] = w[:-1]
            care[i, width - len(w) + 1:] = True
        return cls(device_tensor(prefix, torch.long, device), device_tensor(care, torch.bool, device),
                   device_tensor([w[-1] for w in words], torch.long, device),
                   torch.full((width,), -1, dtype=torch.long, device=device))

    def banned(self, vocab: int) -> torch.Tensor:
        """[V] bool: the last tokens of the words whose other tokens the answer ends with."""
        match = ((self.prefix == self.recent[None, :]) | ~self.care).all(dim=-1)
        hits = torch.zeros(vocab, device=self.last.device).index_add_(0, self.last, match.float())
        return hits > 0

    def append(self, token: torch.Tensor) -> None:
        self.recent = torch.cat([self.recent[1:], token.long()])


def apply(logits: torch.Tensor, states: list[PenaltyState | None], temperatures: list[float],
          produced: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The logits to sample from (a copy where any row is penalised; `logits` itself is left as the
    model gave it, for log probabilities) and the rows changed. `produced[i]`: row i's answer tokens
    so far (for min_tokens)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits, []
    picked = [s for s in states if s is not None]
    dev = logits.device
    index = device_tensor(rows, torch.long, dev)
    x = logits.index_select(0, index).float()
    counts = torch.stack([s.counts for s in picked])
    seen = torch.stack([s.in_prompt for s in picked]) | (counts > 0)
    p = [s.penalties for s in picked]
    rep = device_tensor([q.repetition for q in p], torch.float32, dev)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - device_tensor([q.frequency for q in p], torch.float32, dev)[:, None] * counts
    x = x - device_tensor([q.presence for q in p], torch.float32, dev)[:, None] * (counts > 0)
    x = x + torch.stack([s.bias for s in picked])
    banned = [n for n, (s, row) in enumerate(zip(picked, rows, strict=True)) if produced[row] < s.penalties.min_tokens]
    if banned:
        which = device_tensor(banned, torch.long, dev)
        rows_banned = x[which].masked_fill(torch.stack([picked[n].ban for n in banned]), float("-inf"))
        # a row that the ban would leave no token (allowed_token_ids all end tokens) keeps them
        x[which] = torch.where(torch.isfinite(rows_banned).any(-1, keepdim=True), rows_banned, x[which])
    for n, s in enumerate(picked):
        if s.words is not None:
            x[n] = x[n].masked_fill(s.words.banned(x.shape[-1]), float("-inf"))
    floors = [math.log(q.min_p) * max(temperatures[row], GREEDY_BELOW_TEMPERATURE) if q.min_p > 0 else -math.inf
              for q, row in zip(p, rows, strict=True)]
    if any(math.isfinite(f) for f in floors):
        floor = x.max(dim=-1, keepdim=True).values + device_tensor(floors, torch.float32, dev)[:, None]
        x = x.masked_fill(x < floor, float("-inf"))
    out = logits.clone()
    out[index] = x.to(out.dtype)
    return out, rows


def count(states: list[PenaltyState | None], tokens: torch.Tensor) -> None:
    """Adds each penalised row's sampled token (still on the device) to its counts and its recent tokens."""
    for row, state in enumerate(states):
        if state is not None:
            state.counts.index_add_(0, tokens[row:row + 1].long(), torch.ones(1, device=state.counts.device))
            if state.words is not None:
                state.words.append(tokens[row:row + 1])
