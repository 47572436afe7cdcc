"""Checks of a request's tokens and limits, shared by both servers. Each failure is one line that
names what was wrong and the limit it broke."""

from __future__ import annotations

import numpy as np

from serving.token_ids import TokenIds, as_array


class InvalidRequest(ValueError):
    """Answered with INVALID_ARGUMENT (gRPC) or 400 (HTTP); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(token_ids: TokenIds, vocab_size: int, name: str = "token_ids") -> None:
    """Every id in [0, vocab_size), checked with numpy: no per-token Python work on a server's
    event loop, whatever the prompt's length."""
    ids = as_array(token_ids)
    if not ids.size:
        raise InvalidRequest("the prompt has no tokens", name)
    outside = (ids < 0) | (ids >= vocab_size)
    if outside.any():
        position = int(np.argmax(outside))
        raise InvalidRequest(f"token id {int(ids[position])} at position {position} of {name} is outside the "
                             f"vocabulary [0, {vocab_size})", name)


def check_max_new_tokens(max_new_tokens: int, name: str = "max_new_tokens") -> None:
    if max_new_tokens < 1:
        raise InvalidRequest(f"{name} must be at least 1, got {max_new_tokens}", name)


def check_lengths(prompt_len: int, max_new_tokens: int, max_model_len: int, name: str = "max_new_tokens") -> None:
    """The prompt and the tokens to generate fit the context (max_new_tokens is checked on its own first)."""
    if prompt_len + max_new_tokens > max_model_len:
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + {name} ({max_new_tokens}) = "
                             f"{prompt_len + max_new_tokens} exceeds the context limit of {max_model_len} tokens",
                             name)


MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(salt: str, name: str = "cache_salt") -> None:
    """A prefix-cache namespace: "" (none) or 1-256 printable ASCII characters, space to ~."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"{name} is {len(salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}", name)
    bad = next((i for i, c in enumerate(salt) if not " " <= c <= "~"), None)
    if bad is not None:
        raise InvalidRequest(f"{name} holds {salt[bad]!r} at character {bad}; use printable ASCII (space to ~)", name)
