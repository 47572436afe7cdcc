"""The requests a simulation sends: the seeded load of `client.load` (the same plan, so the same arrival
times and lengths), optionally grouped into multi-turn conversations whose turns re-send their history.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from client.load_plan import BackgroundUser, Length, LoadSpec, build_plan


@dataclass(eq=False)
class SimRequest:
    """One request; times are seconds from the run's start. `history` tokens of the prompt repeat an earlier turn's."""

    key: str
    kind: str                  # "arrival" or "background"
    sent: float
    prompt: int
    output: int
    long: bool = False
    history: int = 0
    conversation: str | None = None
    user: int | None = None    # background user index
    turn: int = 0
    cached: int = 0            # prompt tokens found in the prefix cache where it was prefilled
    server: int = -1           # the decode server it went to
    where: str = ""            # "local" or "remote": where its prefill ran
    prefill_s: float = 0.0     # engine time its prefill took (all its pieces)
    first_token: float = math.nan
    join_step: int = -1        # the first decode step it was part of, on its server
    done: float = math.nan

    @property
    def finished(self) -> bool:
        return not math.isnan(self.done)

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.done - self.first_token) / (self.output - 1) if self.output > 1 else None


@dataclass(frozen=True)
class Conversations:
    """Multi-turn traffic: each arrival of the load spec starts a conversation of `turns` turns; a turn's prompt is
    the history (every earlier prompt and answer) plus `new_tokens`, sent `think_s` after the previous answer ends."""

    turns: str = "1"              # a Length: how many turns a conversation has
    new_tokens: str = "256"       # a Length: a later turn's new prompt tokens
    think_s: float = 0.0          # mean seconds between an answer and the next turn (exponential)
    finish: bool = False          # send every later turn, also past the run's duration (as client.load does)


@dataclass
class Traffic:
    """Arrivals planned up front; background users' and conversations' next requests come when the last ends."""

    spec: LoadSpec
    conversations: Conversations = field(default_factory=Conversations)
    arrivals: list[SimRequest] = field(default_factory=list)
    users: list[BackgroundUser] = field(default_factory=list)

    def __post_init__(self) -> None:
        plan = build_plan(self.spec)
        self.users = plan.users
        self.arrivals = [SimRequest(a.key, "arrival", a.at, len(a.token_ids), a.output_len, a.long)
                         for a in plan.arrivals]
        # a stream of its own, after the ones build_plan spawns, so conversations leave the plan's draws alone
        turns_seed = np.random.SeedSequence(self.spec.seed).spawn(3 + self.spec.background_users)[-1]
        self._rng = np.random.default_rng(turns_seed)
        self._turns = Length.parse(self.conversations.turns)
        self._new = Length.parse(self.conversations.new_tokens)
        self._left: dict[str, int] = {}
        if self._turns.kind != "fixed" or self._turns.a > 1:
            for request in self.arrivals:
                request.conversation = request.key
                self._left[request.key] = self._turns.sample(self._rng) - 1

    def initial(self) -> Iterator[SimRequest]:
        yield from self.arrivals

    def background(self, user: int, at: float) -> SimRequest:
        spec = self.users[user].next()
        return SimRequest(spec.key, "background", at, len(spec.token_ids), spec.output_len, user=user)

    def next_turn(self, previous: SimRequest) -> SimRequest | None:
        """The conversation's next turn after `previous` ended, or None when it was the last."""
        if previous.conversation is None or self._left.get(previous.conversation, 0) <= 0:
            return None
        self._left[previous.conversation] -= 1
        history = previous.prompt + previous.output
        think = float(self._rng.exponential(self.conversations.think_s)) if self.conversations.think_s > 0 else 0.0
        output = previous.output
        return SimRequest(f"{previous.conversation}.{previous.turn + 1}", "arrival", previous.done + think,
                          history + self._new.sample(self._rng), output, previous.long, history,
                          previous.conversation, turn=previous.turn + 1)
