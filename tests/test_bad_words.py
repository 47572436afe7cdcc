"""bad_words on the device (engine.penalties): a word's last token is banned exactly when the
answer's last tokens are the rest of it, words of different lengths side by side in one row."""

from __future__ import annotations

import numpy as np
import torch

from engine import penalties
from engine.penalties import PenaltyState
from engine.penalty_spec import Penalties

VOCAB = 16


def banned_after(answer: list[int], words: tuple[tuple[int, ...], ...]) -> set[int]:
    state = PenaltyState.create(Penalties(bad_words=words), np.array([1, 2]), [], VOCAB, torch.device("cpu"))
    for token in answer:
        penalties.count([state], torch.tensor([token]))
    logits = torch.zeros(1, VOCAB)
    adjusted, rows = penalties.apply(logits, [state], [1.0], [len(answer)])
    assert rows == [0] and torch.equal(logits, torch.zeros(1, VOCAB))  # the model's logits are left as they were
    return {int(t) for t in torch.nonzero(adjusted[0] == float("-inf")).flatten()}


def test_a_words_last_token_is_banned_only_after_the_rest_of_it() -> None:
    words = ((7,), (5, 6), (3, 4, 9))
    assert banned_after([], words) == {7}
    assert banned_after([5], words) == {7, 6}
    assert banned_after([5, 8], words) == {7}
    assert banned_after([3, 4], words) == {7, 9}
    assert banned_after([4], words) == {7}  # half of (3, 4): not the rest of the word
    assert banned_after([3, 4, 9, 5], words) == {7, 6}
    assert banned_after([], ((2, 8),)) == set()  # the prompt ends with 2, but it is not the answer
    assert banned_after([2], ((2, 8),)) == {8}
