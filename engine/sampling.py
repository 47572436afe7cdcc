"""Token sampling: greedy by default; temperature / top-k / top-p with a per-request seed.

A sampled token depends only on (logits, params, seed, output index), never on the batch or on
which server sampled it, so a request's tokens are the same in every mode and transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Temperatures below this sample greedily: dividing logits by a denormal temperature overflows to
# inf, and softmax of inf is NaN (which would fail the whole batch's sampling).
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingError(ValueError):
    """A sampling parameter out of its range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 0.0   # 0 = off (the proto default)
    top_k: int = 0       # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:  # also false for NaN
            raise SamplingError("top_p", f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if 0.0 < p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    gen = torch.Generator(device=logits.device).manual_seed((p.seed * 1_000_003 + index) % (2**63))
    return torch.multinomial(probs, 1, generator=gen).squeeze(0)


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (long, on the logits' device). `greedy`, when given,
    is logits.argmax(-1) already computed (inside a CUDA graph)."""
    if all(p.greedy for p in params):
        return greedy if greedy is not None else logits.argmax(dim=-1)
    tokens = (greedy if greedy is not None else logits.argmax(dim=-1)).clone()
    for row, (p, index) in enumerate(zip(params, indices, strict=True)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, index)
    return tokens
