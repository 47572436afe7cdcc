"""One request as the decode server tracks it, from admission to its last token, and the output
through which its tokens leave the scheduler."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from decode_server.config import PrefillMode
from decode_server.timing import Timing
from engine.grammar import CompiledGrammar, GrammarState
from engine.logprobs import TokenLogprobs
from engine.penalties import PenaltyState
from engine.penalty_spec import Penalties
from engine.sampling import SamplingParams
from serving.grpc_common import StatusError
from serving.token_ids import TokenIds, as_array


class Rejected(StatusError):
    """How a request ends when it does not end with its last token: the status it is answered with."""


@dataclass(slots=True)
class TokenOutput:
    """One token as it leaves the engine's thread for the request's reader, never changed once made;
    not a frozen dataclass, which takes about four times as long to make (one a row of every decode
    step)."""

    token_id: int
    index: int
    finish_reason: str  # "" until the last token
    step_s: float       # the step (prefill or decode) that produced it
    logprobs: TokenLogprobs | None = None  # when the request asked for them


Output = TokenOutput | Rejected


class RequestOutput:
    """A request's outputs in order: its tokens, or a failure that ends them. The scheduler adds
    them on its thread and wakes the reader on the event loop once per step, not once per token."""

    def __init__(self) -> None:
        self._items: deque[Output] = deque()
        self._added = asyncio.Event()

    def add(self, item: Output) -> None:
        """Any thread; the reader sees it once woken (`wake_all`, on the event loop)."""
        self._items.append(item)

    @staticmethod
    def wake_all(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            output._added.set()

    def taken(self) -> list[Output]:
        """Every output added so far, for a caller that drives the scheduler itself (tests)."""
        items = list(self._items)
        self._items.clear()
        return items

    async def next(self) -> Output:
        while not self._items:
            self._added.clear()
            if self._items:
                break
            await self._added.wait()
        return self._items.popleft()


@dataclass
class RequestSequence:
    request_id: str
    prompt: TokenIds  # read with numpy on the engine thread (serving.token_ids)
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]
    mode: PrefillMode
    chunk_size: int
    block_table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # generated so far
    prefilled: int = 0             # prompt tokens already in the pool (local prefill)
    finish_reason: str = ""
    timing: Timing = field(default_factory=Timing)
    out: RequestOutput = field(default_factory=RequestOutput)
    cancelled: threading.Event = field(default_factory=threading.Event)
    prefill_sms: int = 0           # partitioned mode: SMs of its prefill's green context; 0 = the server's
    cache_salt: str = ""           # its prefix-cache namespace; "" = none
    logprobs: int | None = None    # log probabilities of its tokens and this many alternatives; None: none
    prompt_logprobs: int | None = None  # ... of its prompt's tokens too (after the first), filled by its prefill
    prompt_ranks: bool = False     # ... with each prompt token's rank among all tokens (a pass over the vocabulary)
    prompt_logprob_values: list[TokenLogprobs] = field(default_factory=list)
    penalties: Penalties | None = None
    penalty_state: PenaltyState | None = None  # on the device, made by the engine's thread
    grammar: CompiledGrammar | None = None    # structured outputs: what its answer must follow
    grammar_state: GrammarState | None = None  # its matcher, made and advanced by the engine's thread

    def penalties_on(self, vocab: int, device: torch.device) -> PenaltyState | None:
        """Its penalties' state on the device, made at its first use (engine thread); None without any."""
        if self.penalties is not None and self.penalty_state is None:
            self.penalty_state = PenaltyState.create(self.penalties, as_array(self.prompt),
                                                     sorted(self.eos_ids | self.stop_ids), vocab, device)
        return self.penalty_state

    def grammar_on(self) -> GrammarState | None:
        """Its grammar's matcher, made at its first use (engine thread); None without a grammar."""
        if self.grammar is not None and self.grammar_state is None:
            self.grammar_state = GrammarState(self.grammar, sorted(self.eos_ids))
        return self.grammar_state

    def uncached_prompt(self) -> TokenIds | np.ndarray:
        """The prompt's tokens after its cached prefix (`prefilled`): what a local prefill computes."""
        return as_array(self.prompt)[self.prefilled:] if self.prefilled else self.prompt

    def written_tokens(self) -> np.ndarray:
        """The tokens whose KV is in its blocks once it has finished: the prompt and its answer, less
        the answer's last token (sampled, never fed back)."""
        return np.concatenate([as_array(self.prompt), np.asarray(self.tokens[:-1], dtype=np.int64)])

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    def append(self, token: int, step_s: float, now: float, logprobs: TokenLogprobs | None = None) -> TokenOutput:
        """Record a sampled token and decide whether it ends the sequence (on the scheduler's thread)."""
        self.tokens.append(token)
        state = self.grammar_on() if self.grammar is not None else None
        if state is not None:  # its stop tokens are the end tokens: a grammar ends with "eos"
            state.accept(token)
        if len(self.tokens) == 1:
            self.timing.first_token = now
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        return TokenOutput(token, len(self.tokens) - 1, self.finish_reason, step_s, logprobs)
