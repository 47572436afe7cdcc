"""One request as the decode server tracks it, from admission to its last token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from engine.kv_cache import BlockAllocator
from engine.sampling import SamplingParams


@dataclass
class TokenEvent:
    token_id: int
    index: int
    finish_reason: str  # "" until the last token
    step_s: float       # the step (prefill or decode) that produced it


@dataclass
class ErrorEvent:
    code: grpc.StatusCode
    message: str


Event = TokenEvent | ErrorEvent


@dataclass
class Timing:
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    prefill_queue_s: float = 0.0  # behind other prompts on the prefill server
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_exposed_s: float = 0.0   # KV handoff time after the prefill's last layer finished
    kv_start_at_s: float = 0.0  # remote prefill began -> the transfer's start message arrived
    kv_post_s: float = 0.0      # setting up the receive after that message
    kv_post_busy_s: float = 0.0  # the part of kv_post_s inside the set-up's calls (the rest: waiting to run them)
    kv_bytes: int = 0
    kv_transport: str = ""      # "" when prefilled here
    first_token: float = 0.0


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int]
    eos_ids: frozenset[int]
    mode: str
    chunk_size: int
    emit: Callable[[Event], object]  # thread-safe: hands the event to the request's stream
    block_table: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    prefilled: int = 0             # prompt tokens already in the pool (local prefill)
    finish_reason: str = ""
    timing: Timing = field(default_factory=Timing)
    cancelled: threading.Event = field(default_factory=threading.Event)
    in_engine: bool = False        # once True, only the engine thread frees the blocks
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    def append(self, token: int, step_s: float) -> None:
        """Record a sampled token, decide whether it ends the sequence, and emit it."""
        self.output.append(token)
        if len(self.output) == 1:
            self.timing.first_token = time.perf_counter()
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"
        self.emit(TokenEvent(token, len(self.output) - 1, self.finish_reason, step_s))

    def release(self, allocator: BlockAllocator) -> bool:
        """Free the KV blocks exactly once; True if this call freed them."""
        with self._lock:
            if self._released:
                return False
            self._released = True
        allocator.free(self.block_table)
        return True
