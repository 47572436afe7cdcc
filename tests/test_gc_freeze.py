"""Start-up objects frozen before serving: the collector's full passes skip them, and they go back
under it at exit."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

import pytest

from serving.gc_freeze import freeze_startup_objects, unfreeze_startup_objects


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
