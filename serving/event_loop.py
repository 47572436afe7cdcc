"""The event loop the servers run on. The client has its own copy (client.event_loop): a client
imports nothing from the servers, and the servers nothing from the client."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_event_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end on uvloop, or on asyncio's own loop where uvloop is not installed (Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)  # type: ignore[no-any-return]
