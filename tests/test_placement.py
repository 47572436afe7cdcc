"""Prefill mode auto's choice, on its inputs."""

from __future__ import annotations

import pytest

from decode_server.config import DecodeConfig
from decode_server.placement import LOCAL, REMOTE, PlacementInputs, PlacementThresholds, place

T = PlacementThresholds(local_tokens=512, idle_local_tokens=2048, remote_backlog_tokens=32768)


def where(uncached: int, decoding: int = 1, backlog: int = 0, ready: bool = True) -> str:
    return place(T, PlacementInputs(uncached, decoding, backlog, ready))


def test_short_prompts_stay_local_long_ones_go_remote_while_others_decode() -> None:
    assert where(64) == LOCAL and where(512) == LOCAL
    assert where(513) == REMOTE and where(3000) == REMOTE


def test_nobody_decoding_keeps_medium_prompts_local() -> None:
    assert where(2048, decoding=0) == LOCAL
    assert where(2049, decoding=0) == REMOTE


def test_a_prefill_backlog_or_no_prefill_server_keeps_prefills_local() -> None:
    assert where(3000, backlog=32767) == REMOTE
    assert where(3000, backlog=32768) == LOCAL
    assert where(30000, ready=False) == LOCAL


def test_thresholds_are_flags_and_not_negative() -> None:
    assert DecodeConfig(auto_local_tokens=100).placement_thresholds == PlacementThresholds(100, 1024, 98304)
    with pytest.raises(ValueError, match="--auto-local-tokens"):
        DecodeConfig(auto_idle_local_tokens=-1)
