"""Where one request's time went on the decode server: the record each response carries
(`to_proto`) and the request log's line ends with (`to_log`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd.v1 import decode_pb2


@dataclass
class Timing:
    """perf_counter instants (arrival, admitted, first_token) and durations in seconds."""

    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0         # its KV blocks were reserved
    prefill_queue_s: float = 0.0  # behind other prompts on the prefill server
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_exposed_s: float = 0.0     # KV handoff time after the prefill's last layer finished
    kv_start_at_s: float = 0.0    # remote prefill began -> the transfer's start message arrived
    kv_post_s: float = 0.0        # setting up the receive after that message
    kv_post_busy_s: float = 0.0   # the part of kv_post_s inside the set-up's calls (the rest: waiting to run them)
    kv_bytes: int = 0
    kv_transport: str = ""        # "" when prefilled here
    first_token: float = 0.0

    @property
    def queue_s(self) -> float:
        return max(0.0, self.admitted - self.arrival)

    def remote_prefill_done(self, *, queue_s: float, prefill_s: float, kv_transfer_s: float, kv_exposed_s: float,
                            kv_bytes: int, transport: str, start_at_s: float, post_s: float,
                            post_busy_s: float) -> None:
        """A prefill server prefilled the prompt and its KV is in this server's pool."""
        self.prefill_queue_s, self.prefill_s, self.kv_transfer_s = queue_s, prefill_s, kv_transfer_s
        self.kv_exposed_s, self.kv_bytes, self.kv_transport = kv_exposed_s, kv_bytes, transport
        self.kv_start_at_s, self.kv_post_s, self.kv_post_busy_s = start_at_s, post_s, post_busy_s

    def to_proto(self, now: float, step_s: float) -> decode_pb2.ServerTiming:
        """As sent with a token produced by a step of `step_s` seconds, at perf_counter `now`."""
        return decode_pb2.ServerTiming(
            queue_s=self.admitted - self.arrival, prefill_s=self.prefill_s, kv_transfer_s=self.kv_transfer_s,
            first_token_s=self.first_token - self.arrival, decode_step_s=step_s, since_arrival_s=now - self.arrival,
            kv_bytes=self.kv_bytes, kv_exposed_s=self.kv_exposed_s, kv_transport=self.kv_transport,
            prefill_queue_s=self.prefill_queue_s)

    def to_log(self, now: float) -> dict[str, float | None]:
        """The request log's timing fields, for a request that ended at perf_counter `now`."""
        return {
            "queue_s": round(self.queue_s, 6), "prefill_queue_s": round(self.prefill_queue_s, 6),
            "prefill_s": round(self.prefill_s, 6), "kv_transfer_s": round(self.kv_transfer_s, 6),
            "kv_exposed_s": round(self.kv_exposed_s, 6), "kv_start_at_s": round(self.kv_start_at_s, 6),
            "kv_post_s": round(self.kv_post_s, 6), "kv_post_busy_s": round(self.kv_post_busy_s, 6),
            "ttft_s": round(self.first_token - self.arrival, 6) if self.first_token else None,
            "e2e_s": round(now - self.arrival, 6)}
