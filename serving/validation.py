"""Checks of a request's tokens and limits, shared by both servers. Each failure is one line that
names what was wrong and the limit it broke."""

from __future__ import annotations

import numpy as np

from serving.token_ids import TokenIds, as_array


class InvalidRequest(ValueError):
    """Answered with INVALID_ARGUMENT."""


def check_token_ids(token_ids: TokenIds, vocab_size: int) -> None:
    """Every id in [0, vocab_size), checked with numpy: no per-token Python work on a server's
    event loop, whatever the prompt's length."""
    ids = as_array(token_ids)
    if not ids.size:
        raise InvalidRequest("the prompt has no tokens")
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        position = int(np.argmax(outside))
        raise InvalidRequest(f"token id {int(ids[position])} at position {position} is outside the vocabulary "
                             f"[0, {vocab_size})")


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise InvalidRequest(f"max_new_tokens must be at least 1, got {max_new_tokens}")


def check_lengths(prompt_len: int, max_new_tokens: int, max_model_len: int) -> None:
    """The prompt and the tokens to generate fit the context (max_new_tokens is checked on its own first)."""
    if prompt_len + max_new_tokens > max_model_len:
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = "
                             f"{prompt_len + max_new_tokens} exceeds the context limit of {max_model_len} tokens")
