"""Tokenizers: the tiny preset's own byte tokenizer, or a checkpoint's through transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; 256 is BOS, 257 is EOS. Fits the tiny preset's vocabulary."""

    BOS, EOS = 256, 257
    eos_token_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint folder's own tokenizer, through transformers."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(folder)
        eos = self._tok.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (int(eos),)

    @classmethod
    def maybe_load(cls, folder: Path) -> HFTokenizer | None:
        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        return cls(folder)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


class StreamDetokenizer:
    """Turns a token stream into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[self._emitted:]
        self._emitted = len(text)
        return piece
