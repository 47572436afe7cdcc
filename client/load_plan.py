"""The load a run sends, drawn from one seed so that two runs (or two deployments) get identical requests.

Arrivals are planned up front. Background users draw their requests lazily (how many they send
depends on how fast the server is), each from its own stream spawned from the same seed, so the
arrivals never shift when a background user manages one more request. With several turns an arrival
starts a conversation: its later turns' user messages come from a stream of their own, so the
arrivals are the same whatever the number of turns.

An `id_salt` relabels every token id through a permutation of its own: the same lengths, times and
turns, but prompts that share no prefix with another salt's, so runs that share a server's prefix
cache (deployments in turn, or the rates of a sweep) do not find each other's prompts in it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

PROMPT_ID_LIMIT = 256  # prompt ids drawn from [0, 256): inside every preset's vocabulary, even the tiny one


@dataclass(frozen=True)
class Length:
    """A token-length distribution: `N`, `uniform:LO:HI` (inclusive) or `lognormal:MEAN:SIGMA`."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Length:
        name, *params = text.strip().split(":")
        try:
            values = [float(p) for p in params]
            if not params:
                length = cls("fixed", float(int(name)))
            elif name == "uniform" and len(values) == 2:
                length = cls("uniform", float(int(values[0])), float(int(values[1])))
            elif name == "lognormal" and len(values) == 2:
                length = cls("lognormal", values[0], values[1])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length {text!r}: use N, uniform:LO:HI or lognormal:MEAN:SIGMA") from None
        length.check(text)
        return length

    def check(self, text: str) -> None:
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or (self.kind == "lognormal" and self.b < 0):
            raise ValueError(f"bad length {text!r}: lengths are >= 1, LO <= HI, SIGMA >= 0")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        # MEAN is the lengths' mean, so the underlying normal's mu is ln(MEAN) - SIGMA^2 / 2
        mu = math.log(self.a) - self.b ** 2 / 2
        return max(1, round(float(rng.lognormal(mu, self.b))))


@dataclass(frozen=True)
class LoadSpec:
    """Everything that decides which requests a run sends and when; the seed makes it reproducible."""

    rate: float = 4.0
    duration: float = 30.0
    prompt_len: str = "1024"
    output_len: str = "128"
    long_prompt_frac: float = 0.0
    long_prompt_len: int = 16384
    background_users: int = 0
    background_prompt_len: str | None = None
    background_output_len: str | None = None
    seed: int = 0
    turns: int = 1
    turn_prompt_len: str | None = None
    id_salt: int = 0  # not 0: every token id relabelled by a permutation drawn from (seed, id_salt)

    def __post_init__(self) -> None:
        if self.rate < 0 or self.duration <= 0:
            raise ValueError("--rate must be >= 0 and --duration > 0")
        if self.rate == 0 and self.background_users == 0:
            raise ValueError("nothing to send: give --rate > 0 or --background-users > 0")
        if not 0.0 <= self.long_prompt_frac <= 1.0 or self.long_prompt_len < 1:
            raise ValueError("--long-prompt-frac must be in [0, 1] and --long-prompt-len >= 1")
        if self.background_users < 0:
            raise ValueError("--background-users must be >= 0")
        if self.turns < 1:
            raise ValueError("--turns must be >= 1")
        for text in (self.prompt_len, self.output_len, self.background_prompt_len, self.background_output_len,
                     self.turn_prompt_len):
            if text is not None:
                Length.parse(text)


@dataclass(frozen=True, eq=False)
class Turn:
    """A later turn of a conversation: the user's new message, and how many tokens the answer gets."""

    message: np.ndarray
    output_len: int


@dataclass(frozen=True, eq=False)
class RequestSpec:
    """One request of the plan; `at` is its send time in seconds from the start (0 for background users).

    An arrival with `later_turns` opens a conversation: once its answer is complete, the next turn
    sends this prompt, the answer, and the next message (`follow_up`), and so on."""

    key: str
    kind: str  # "arrival", "turn" (a conversation's second or later) or "background"
    at: float
    token_ids: np.ndarray
    output_len: int
    long: bool = False
    later_turns: tuple[Turn, ...] = ()
    turn: int = 1

    def follow_up(self, answer: list[int], at: float) -> RequestSpec | None:
        """The conversation's next request, once this one was answered with `answer`; None after the last turn."""
        if not self.later_turns:
            return None
        nxt, *rest = self.later_turns
        base = self.key.split(".t", 1)[0]
        history = np.concatenate([self.token_ids, np.asarray(answer, dtype=np.int32), nxt.message])
        return RequestSpec(f"{base}.t{self.turn + 1}", "turn", at, history, nxt.output_len, False, tuple(rest),
                           self.turn + 1)

    def signature(self) -> tuple[str, float, int, tuple[int, ...]]:
        return self.key, self.at, self.output_len, tuple(self.token_ids.tolist())


def id_relabelling(spec: LoadSpec) -> np.ndarray | None:
    """The map from drawn token ids to sent ones: a permutation drawn from (seed, id_salt); None without a salt."""
    if not spec.id_salt:
        return None
    return np.random.default_rng([spec.seed, spec.id_salt]).permutation(PROMPT_ID_LIMIT).astype(np.int32)


def _prompt(rng: np.random.Generator, length: int) -> np.ndarray:
    return rng.integers(0, PROMPT_ID_LIMIT, size=length, dtype=np.int32)


class BackgroundUser:
    """A user who decodes back to back: its n-th request is the same in every run with the same seed."""

    def __init__(self, index: int, spec: LoadSpec, seed: np.random.SeedSequence) -> None:
        self.index, self.sent, self.relabel = index, 0, id_relabelling(spec)
        self.rng = np.random.default_rng(seed)
        self.prompt_len = Length.parse(spec.background_prompt_len or spec.prompt_len)
        self.output_len = Length.parse(spec.background_output_len or spec.output_len)

    def next(self) -> RequestSpec:
        key = f"bg{self.index}.{self.sent}"
        self.sent += 1
        prompt = _prompt(self.rng, self.prompt_len.sample(self.rng))
        sent = prompt if self.relabel is None else self.relabel[prompt]
        return RequestSpec(key, "background", 0.0, sent, self.output_len.sample(self.rng))


@dataclass
class LoadPlan:
    spec: LoadSpec
    arrivals: list[RequestSpec]
    users: list[BackgroundUser]


def plan_turns(spec: LoadSpec, rng: np.random.Generator) -> tuple[Turn, ...]:
    """An arrival's later turns (none with --turns 1)."""
    message_len, output_len = Length.parse(spec.turn_prompt_len or spec.prompt_len), Length.parse(spec.output_len)
    turns = []
    for _ in range(spec.turns - 1):
        n, out = message_len.sample(rng), output_len.sample(rng)
        turns.append(Turn(_prompt(rng, n), out))
    return tuple(turns)


def plan_arrivals(spec: LoadSpec, times: np.random.Generator, ids: np.random.Generator,
                  turns: np.random.Generator | None = None) -> list[RequestSpec]:
    """Poisson arrivals (exponential gaps at `rate`) over `duration`, each with its own prompt and output length.

    Times, lengths and the long-prompt coin come from `times`, token ids from `ids`, later turns from
    `turns`: every draw is made for every arrival, so changing one length knob leaves the arrival
    times and other lengths as they were.
    """
    prompt_len, output_len = Length.parse(spec.prompt_len), Length.parse(spec.output_len)
    arrivals: list[RequestSpec] = []
    t = 0.0
    while spec.rate > 0:
        t += float(times.exponential(1.0 / spec.rate))
        if t >= spec.duration:
            break
        long = bool(times.random() < spec.long_prompt_frac)
        short_len, out_len = prompt_len.sample(times), output_len.sample(times)
        prompt = _prompt(ids, spec.long_prompt_len if long else short_len)
        later = plan_turns(spec, turns) if turns is not None else ()
        arrivals.append(RequestSpec(f"r{len(arrivals)}", "arrival", t, prompt, out_len, long, later))
    return arrivals


def build_plan(spec: LoadSpec) -> LoadPlan:
    """A fresh plan (background users restart from their first request), identical for identical specs."""
    times_seed, ids_seed, *user_seeds = np.random.SeedSequence(spec.seed).spawn(2 + spec.background_users)
    users = [BackgroundUser(k, spec, s) for k, s in enumerate(user_seeds)]
    turns_seed = ids_seed.spawn(1)[0]  # a child stream: the arrivals' own draws stay as they were
    arrivals = plan_arrivals(spec, np.random.default_rng(times_seed), np.random.default_rng(ids_seed),
                             np.random.default_rng(turns_seed))
    if (relabel := id_relabelling(spec)) is not None:
        arrivals = [dataclasses.replace(a, token_ids=relabel[a.token_ids], later_turns=tuple(
                        Turn(relabel[t.message], t.output_len) for t in a.later_turns)) for a in arrivals]
    return LoadPlan(spec, arrivals, users)
