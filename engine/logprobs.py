"""Log probabilities of sampled tokens, and of the most likely alternatives, for the rows of a step
that ask for them: from the raw logits the sampler was given (before temperature and any filter),
as vLLM returns them by default. A step where no row asks computes nothing here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def device_tensor(values: Sequence[float] | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on the device without waiting for it: a copy from pageable memory would first wait
    for the stream (the step in flight); from pinned memory it is queued behind it."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log probability, and the `top` most likely tokens' (id, log probability), best first;
    `rank`: its place among all tokens (1: the likeliest), where it was asked for."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class StepLogprobs:
    """A step's log probabilities on the device, queued behind its sampling; read once its tokens are."""

    rows: list[int]          # the step's rows that asked, in order
    tops: list[int]          # how many alternatives each of them asked for
    chosen: torch.Tensor     # [R] the sampled tokens' log probabilities
    top_values: torch.Tensor  # [R, K]
    top_ids: torch.Tensor     # [R, K]
    ranks: torch.Tensor | None = None  # [R], where asked for

    @classmethod
    def queue(cls, logits: torch.Tensor, tokens: torch.Tensor, asked: list[int | None],
              rank: bool = False) -> StepLogprobs | None:
        """`asked[i]`: how many alternatives row i wants (0: the sampled token's alone), None: nothing;
        `rank`: each token's place too (one comparison over the vocabulary a row)."""
        rows = [i for i, k in enumerate(asked) if k is not None]
        if not rows:
            return None
        tops = [asked[i] or 0 for i in rows]
        index = device_tensor(rows, torch.long, logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index).long()[:, None])[:, 0]
        top_values, top_ids = logprobs.topk(max(1, max(tops)), dim=-1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1 if rank else None
        return cls(rows, tops, chosen, top_values, top_ids, ranks)

    def read(self, batch: int) -> list[TokenLogprobs | None]:
        """One entry a row of the step (None where it did not ask); waits for the device."""
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        ranks = self.ranks.tolist() if self.ranks is not None else [None] * len(self.rows)
        out: list[TokenLogprobs | None] = [None] * batch
        for n, (row, k) in enumerate(zip(self.rows, self.tops, strict=True)):
            out[row] = TokenLogprobs(chosen[n], tuple(zip(ids[n][:k], values[n][:k], strict=True)), ranks[n])
        return out
