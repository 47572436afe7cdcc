"""The objects a server builds before it serves (its modules, the model, the kernels: about 375k
tracked objects with the tiny model on the CPU, more on a GPU) are kept out of the garbage
collector's full passes. A full pass walks every tracked object while holding the GIL, so every
thread of the process waits for its whole length, the event loop included: 250-280 ms on a 2-core CPU
with the tiny model. Long-lived objects made while serving (the prefix cache's entries: 2,048 for
a 32k-token prompt) bring the next full pass closer. Frozen, the start-up objects are never walked
again, and a full pass takes a few ms (bench/NOTES.md)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Just before serving: collect what start-up left over, then freeze every object that survived.
    Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects frozen: the garbage collector's full passes skip them", frozen)
    return frozen


def unfreeze_startup_objects() -> None:
    """At exit: the frozen objects back under the collector, so the interpreter's last passes
    finalize them (native extensions report objects never finalized as leaks)."""
    gc.unfreeze()
