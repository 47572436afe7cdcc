"""Confining a thread's GPU work to a share of the SMs: CUDA green contexts, behind one interface.

Only the confined work (partitioned mode's prefill) gets a green context; everything else stays on
the primary context, which keeps every SM. Two green contexts made by separate `create` calls may
overlap, and decode in a green context of its own ran far slower than on the primary context, so
nothing here confines decode.

PyTorch's API moved between releases: 2.10 has `GreenContext.create(num_sms, device_id)` with
`set_context()` / `pop_context()`, later releases add `Stream()` (a stream of the green context)
and make `create`'s arguments keyword-only. `GreenContexts.confine` uses `Stream()` where it
exists: the thread's current stream becomes the green context's, the current context stays the
primary one. Otherwise it pushes the green context, whose work then runs on that context's null
stream; PyTorch's caching allocator cannot tell that stream from the primary context's null stream,
so the confined block also allocates from a memory pool of its own, and the stream it came from
(which `pop_context` makes wait for the green work) is a private one, never the null stream that
the other threads share.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class SmPartitions(Protocol):
    """Runs a block of GPU work on `num_sms` SMs of the device, beside the rest of the process."""

    @property
    def confined(self) -> bool:
        """False where the work only moves to another thread, on every SM (the CPU, tests)."""
        ...

    @property
    def streams_of_their_own(self) -> bool:
        """True where confined work runs on a stream of its partition's own, so that CUDA graphs captured
        and replayed on it keep to the partition's SMs too."""
        ...

    def check(self, num_sms: int) -> str | None:
        """Why the device can't give `num_sms` SMs to a partition, in one line; None if it can."""
        ...

    def confine(self, num_sms: int) -> contextlib.AbstractContextManager[None]:
        """The calling thread's GPU work inside the block runs on `num_sms` SMs."""
        ...


class Unconfined:
    """The work runs where it would anyway (any count is accepted): the CPU, and the tests of the
    thread that runs partitioned prefills."""

    confined = False
    streams_of_their_own = False

    def check(self, num_sms: int) -> str | None:
        return None if num_sms > 0 else f"a partition needs at least one SM, got {num_sms}"

    @contextlib.contextmanager
    def confine(self, num_sms: int) -> Iterator[None]:
        yield


def split_granularity(major: int) -> tuple[int, int]:
    """(fewest SMs, step) of a green context's SM count on a GPU of compute capability `major`.x,
    as the driver splits SMs (cuDevSmResourceSplitByCount rounds a count up to the step)."""
    if major >= 9:
        return 8, 8
    if major == 8:
        return 4, 2
    if major == 7:
        return 2, 2
    return 1, 1


def split_problem(num_sms: int, total_sms: int, capability: tuple[int, int]) -> str | None:
    """Why a device of `total_sms` SMs and compute `capability` can't give exactly `num_sms` SMs to a
    green context and keep some for the rest, in one line; None if it can."""
    fewest, step = split_granularity(capability[0])
    if num_sms < fewest or num_sms % step:
        nearest = max(fewest, -(-num_sms // step) * step)
        return (f"{num_sms} SMs: compute capability {capability[0]}.{capability[1]} splits SMs in multiples of "
                f"{step} (at least {fewest}); use {nearest}")
    if num_sms > total_sms - step:
        return f"{num_sms} SMs: the device has {total_sms}; leave some to decode (at most {total_sms - step})"
    return None


def unavailable(device: torch.device) -> str | None:
    """Why `device` has no green contexts, in one line; None if this torch and device have them."""
    if device.type != "cuda":
        return f"green contexts need a CUDA device; this server runs on {device.type}"
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return f"torch {torch.__version__} has no torch.cuda.green_contexts (added in 2.10)"
    if not getattr(green_contexts, "SUPPORTED", False):
        return f"torch {torch.__version__} was built without green contexts (needs CUDA 12.8+)"
    return None


def _create(num_sms: int, device_index: int) -> Any:
    """A green context of `num_sms` SMs, whichever signature this torch's `create` has."""
    from torch.cuda.green_contexts import GreenContext

    create = getattr(GreenContext, "create", None)
    if create is None:
        return GreenContext(num_sms=num_sms, device_id=device_index)  # type: ignore[call-arg]
    return create(num_sms=num_sms, device_id=device_index)


def _as_cuda_stream(stream: Any) -> torch.cuda.Stream:
    """`torch.cuda.stream` wants a torch.cuda.Stream; some releases' `Stream()` give a torch.Stream."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    return torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                             device_type=stream.device_type)


class GreenContexts:
    """Green contexts of `device`, one per SM count asked for, made on first use and kept."""

    confined = True

    def __init__(self, device: torch.device) -> None:
        from torch.cuda.green_contexts import GreenContext

        self.streams_of_their_own = hasattr(GreenContext, "Stream")
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(self.index)
        self.total_sms = props.multi_processor_count
        self.capability = (props.major, props.minor)
        self._lock = threading.Lock()
        self._contexts: dict[int, Any] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pools: dict[int, tuple[Any, torch.cuda.Stream]] = {}

    def check(self, num_sms: int) -> str | None:
        return split_problem(num_sms, self.total_sms, self.capability)

    def prepare(self, num_sms: int) -> None:
        """Make `num_sms`'s green context now (it raises here, at start-up, where the driver can't)."""
        problem = self.check(num_sms)
        if problem:
            raise ValueError(problem)
        with self._lock:
            if num_sms in self._contexts:
                return
            torch.cuda.synchronize(self.device)  # a runtime call: the primary context is current on this thread
            context = _create(num_sms, self.index)
            self._contexts[num_sms] = context
            if hasattr(context, "Stream"):
                self._streams[num_sms] = _as_cuda_stream(context.Stream())
            else:
                self._pools[num_sms] = torch.cuda.MemPool(), torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def confine(self, num_sms: int) -> Iterator[None]:
        self.prepare(num_sms)
        stream = self._streams.get(num_sms)
        if stream is not None:
            with torch.cuda.stream(stream):
                yield
            return
        context = self._contexts[num_sms]
        pool, parent = self._pools[num_sms]
        with torch.cuda.stream(parent), torch.cuda.use_mem_pool(pool, self.device):
            context.set_context()
            try:
                yield
            finally:
                context.pop_context()
