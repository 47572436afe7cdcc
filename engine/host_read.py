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

    def read(self, tokens: torch.Tensor) -> list[int]:
        """`tokens` ([n], integer, on the reader's device) as Python ints, once the device has them."""
        if self.done is None or not tokens.is_cuda:
            return [int(t) for t in tokens.tolist()]
        n = tokens.numel()
        if n > self.host.numel():
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.long, pin_memory=True)
        out = self.host[:n]
        out.copy_(tokens.reshape(-1), non_blocking=True)
        self.done.record()
        self.done.synchronize()
        return out.tolist()
