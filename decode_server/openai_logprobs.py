"""Log probabilities in OpenAI's shapes: chat's `logprobs.content` entries ({token, logprob, bytes,
top_logprobs}) and completions' four parallel lists ({tokens, token_logprobs, top_logprobs,
text_offset}), a token at a time (one SSE event) or for the whole answer. A token's text is its own
decoding, special tokens included; without a tokenizer, or with vLLM's `return_tokens_as_token_ids`,
it is `token_id:<id>`, as vLLM writes it."""

from __future__ import annotations

from typing import Any

from engine.logprobs import TokenLogprobs
from engine.tokenizer import Tokenizer


class LogprobFormat:
    def __init__(self, tokenizer: Tokenizer | None, chat: bool, as_ids: bool = False) -> None:
        self.tokenizer, self.chat, self.as_ids = tokenizer, chat, as_ids
        self.entries: list[dict[str, Any]] = []  # chat: content entries; completions: (token, lp, top, offset)

    def text(self, token_id: int) -> str:
        if self.tokenizer is None or self.as_ids:
            return f"token_id:{token_id}"
        return str(self.tokenizer.backend.decode([token_id], skip_special_tokens=False))

    def add(self, token_id: int, logprobs: TokenLogprobs, offset: int) -> dict[str, Any]:
        """Records a token's log probabilities (`offset`: where its text starts in the answer's) and
        returns them as one streamed event's `logprobs`."""
        token = self.text(token_id)
        if self.chat:
            entry: dict[str, Any] = {
                "token": token, "logprob": logprobs.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := self.text(i)), "logprob": lp, "bytes": list(t.encode())}
                                 for i, lp in logprobs.top]}
            self.entries.append(entry)
            return {"content": [entry]}
        top: dict[str, float] = {}
        for i, lp in logprobs.top:  # best first: where two tokens read the same, the likelier one's
            top.setdefault(self.text(i), lp)
        top.setdefault(token, logprobs.logprob)  # the sampled token's is always there, as OpenAI's
        entry = {"token": token, "logprob": logprobs.logprob, "top": top, "offset": offset}
        self.entries.append(entry)
        return self._completions([entry])

    def add_prompt(self, token_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        """A completion's echoed prompt: its first token has no log probability (nothing precedes it)."""
        offset = 0
        for n, token_id in enumerate(token_ids):
            token = self.text(token_id)
            if n == 0:
                self.entries.append({"token": token, "logprob": None, "top": None, "offset": 0})
            else:
                self.add(token_id, logprobs[n - 1], offset)
            offset += len(token)

    def streamed(self, start: int) -> dict[str, Any]:
        """The entries recorded since `start` as one streamed event's `logprobs` (an echo's first
        event: the prompt's and the first token's)."""
        return {"content": self.entries[start:]} if self.chat else self._completions(self.entries[start:])

    def whole(self) -> dict[str, Any]:
        """The answer's log probabilities, as a non-streamed choice's `logprobs`."""
        return {"content": self.entries} if self.chat else self._completions(self.entries)

    @staticmethod
    def _completions(entries: list[dict[str, Any]]) -> dict[str, Any]:
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": [e["offset"] for e in entries]}

    def vllm_prompt(self, token_ids: list[int], logprobs: list[TokenLogprobs], top: int) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: None for the first token (nothing precedes it), then for each one a
        map from token id to {logprob, rank, decoded_token}: the prompt's token and the `top` likeliest."""
        out: list[dict[str, Any] | None] = [None]
        for token_id, lp in zip(token_ids[1:], logprobs, strict=True):
            entry = {str(i): {"logprob": v, "rank": n + 1, "decoded_token": self.text(i)}
                     for n, (i, v) in enumerate(lp.top[:top])}
            entry.setdefault(str(token_id), {"logprob": lp.logprob, "rank": lp.rank,
                                             "decoded_token": self.text(token_id)})
            out.append(entry)
        return out

