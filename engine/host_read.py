"""Reading sampled tokens to the host through pinned memory and an event.

`tensor.tolist()` on a CUDA tensor is a synchronous copy into pageable memory: the driver stages
it and the calling thread sits inside that CUDA call until the whole step before it has run. The
servers' other threads (gRPC, the KV handoffs) make CUDA calls of their own meanwhile; reading
into a pinned buffer behind an event leaves the driver free while the step runs (vLLM and
SGLang read sampled tokens the same way).
"""

from __future__ import annotations

import torch


class TokenReader:
    """One reader per thread, whose current device is the tokens' (the event is recorded on its
    current stream, where the copy is queued); the pinned buffer is reused by every read."""

    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        cuda = device.type == "cuda"
        self.host = torch.empty(capacity if cuda else 0, dtype=torch.long, pin_memory=cuda)
        self.done = torch.cuda.Event() if cuda else None
        self._pending = torch.empty(0, dtype=torch.long)  # the host tensor `take` reads
        self._copying = False  # `done` marks the copy into `_pending`

    def read(self, tokens: torch.Tensor) -> list[int]:
        """`tokens` ([n], integer, on the reader's device) as Python ints, once the device has them."""
        self.start(tokens)
        return self.take()

    def start(self, tokens: torch.Tensor) -> None:
        """Queue the read of `tokens`; `ready()` says when `take()` would not wait for the device."""
        self._copying = self.done is not None and tokens.is_cuda
        if not self._copying:
            self._pending = tokens
            return
        n = tokens.numel()
        if n > self.host.numel():
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.long, pin_memory=True)
        self._pending = self.host[:n]
        self._pending.copy_(tokens.reshape(-1), non_blocking=True)
        assert self.done is not None
        self.done.record()

    def ready(self) -> bool:
        return not self._copying or self.done is None or self.done.query()

    def take(self) -> list[int]:
        """The tokens of the last `start`, once the device has them."""
        if self._copying and self.done is not None:
            self.done.synchronize()
        return self._pending.tolist()
