"""Start-up objects frozen before serving: the collector's full passes skip them, and they go back
under it at exit."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from serving.gc_freeze import GcPauses, freeze_startup_objects, unfreeze_startup_objects


@pytest.fixture
def thawed_after() -> Iterator[None]:
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("thawed_after")
def test_a_full_pass_skips_what_was_frozen_and_unfreeze_gives_it_back() -> None:
    startup = [[i] for i in range(200_000)]  # tracked objects, like a server's modules and model
    started = time.perf_counter()
    gc.collect()
    unfrozen_pass = time.perf_counter() - started
    assert freeze_startup_objects() >= len(startup)
    started = time.perf_counter()
    gc.collect()
    frozen_pass = time.perf_counter() - started
    assert frozen_pass < unfrozen_pass / 2, (frozen_pass, unfrozen_pass)  # loose: the machine is shared
    unfreeze_startup_objects()
    assert gc.get_freeze_count() == 0


def test_gc_pauses_records_each_pass_and_finds_the_longest_in_a_window() -> None:
    pauses = GcPauses()
    pauses.start()
    try:
        before = time.perf_counter()
        gc.collect()
        after = time.perf_counter()
    finally:
        pauses.stop()
    assert pauses.passes, "no pass recorded"
    longest = pauses.max_between(before, after)
    assert 0 < longest <= after - before
    assert pauses.max_between(after + 1, after + 2) == 0.0  # a window after the pass
    recorded = len(pauses.passes)
    gc.collect()
    assert len(pauses.passes) == recorded  # stopped: no longer called
