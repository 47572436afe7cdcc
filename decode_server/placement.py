"""Prefill mode `auto`: per request, a local prefill or a remote one.

A remote prefill costs a handoff (the prefill server's queue, the KV transfer, the decode side's
receive) but leaves this GPU's decode steps alone; a local one costs no handoff but stalls every
sequence decoding here for as long as it computes. So a short prompt (few uncached tokens) stays
local, as does a longer one when nobody here is decoding, and a long one goes remote unless the
prefill servers already have a backlog that would cost more than computing it here.
"""

from __future__ import annotations

from dataclasses import dataclass

LOCAL, REMOTE = "local", "remote"


@dataclass(frozen=True)
class PlacementThresholds:
    local_tokens: int          # at most this many uncached tokens: local even while others decode
    idle_local_tokens: int     # at most this many: local when nobody decodes here
    remote_backlog_tokens: int  # the prefill servers' uncached tokens in flight past which prefills stay local


@dataclass(frozen=True)
class PlacementInputs:
    uncached_tokens: int       # prompt tokens this server's prefix cache does not hold
    decoding: int              # sequences in this server's decode batch now
    remote_backlog_tokens: int  # uncached tokens the prefill servers hold: ours in flight, or their last report
    remote_ready: bool         # a prefill server is configured and reachable


def place(t: PlacementThresholds, x: PlacementInputs) -> str:
    """LOCAL or REMOTE."""
    if not x.remote_ready or x.uncached_tokens <= t.local_tokens:
        return LOCAL
    if x.decoding == 0 and x.uncached_tokens <= t.idle_local_tokens:
        return LOCAL
    if x.remote_backlog_tokens >= t.remote_backlog_tokens:
        return LOCAL
    return REMOTE
