"""What a request asks of its logits before sampling (penalties, logit bias, min_tokens, min_p, allowed
tokens, banned words), as the front ends read it; applied on the device by `engine.penalties`. Kept
apart from torch so that the request readers (the HTTP API's render worker among them) import none."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    allowed: tuple[int, ...] = ()  # empty: every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the answer may not end with

    @property
    def active(self) -> bool:
        return self != Penalties()
