"""Text in and out of the engine: a checkpoint's tokenizer and chat template (through transformers,
local files only), a streaming detokenizer that never splits a character, and stop strings.

What a front door needs per request:
  ids = tokenizer.apply_chat_template(messages)   # or tokenizer.encode(prompt)
  detok, stops = StreamDetokenizer(tokenizer), StopMatcher(["\\n\\n"])
  for each token: text, stopped = stops.feed(detok.step(token_id)); send text; end if stopped
  at the end (no stop): send stops.flush()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# encode_within counts a long text in pieces of about this many characters a token of the limit,
# each cut adding at most COUNT_SLACK_TOKENS tokens to the sum (a split word, a special token cut in two)
COUNT_PIECE_CHARS_PER_TOKEN, COUNT_SLACK_TOKENS = 4, 32


class ChatTemplateError(ValueError):
    """The messages can't be rendered: no chat template, or the template refused them."""


@dataclass(frozen=True)
class ChatOptions:
    """How a chat template renders a chat (the fields of vLLM's chat API of these names)."""

    add_generation_prompt: bool = True    # end with the assistant's turn opened, for the answer
    continue_final_message: bool = False  # end inside the last message, for the answer to continue it
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the template's own variables (enable_thinking)


class Tokenizer:
    """A transformers fast tokenizer: encode, decode, chat template, end-of-turn ids."""

    def __init__(self, hf: Any) -> None:
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ValueError(f"{type(hf).__name__} is not a fast tokenizer; the folder needs a tokenizer.json")
        self._hf = hf
        ids = [hf.convert_tokens_to_ids(t) for t in (hf.eos_token,) if t is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in ids if i is not None)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        """The folder's own tokenizer files; never the hub."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(folder, local_files_only=True))

    @classmethod
    def maybe_from_folder(cls, folder: Path) -> Tokenizer | None:
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            return None
        return cls.from_folder(folder)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer itself (for libraries that read its vocabulary)."""
        return self._hf

    @property
    def backend(self) -> BackendTokenizer:
        return self._hf.backend_tokenizer  # type: ignore[no-any-return]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    @property
    def chat_template(self) -> str:
        """Its chat template's text ("" for none)."""
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids, with the tokenizer's own BOS where it adds one (Llama, Mistral): the ids
        transformers' `encode` gives, from the backend's `encode_batch_fast`, which lets the GIL go while
        it tokenizes and computes no character offsets (a 128k-character text: the GIL held 0.5 ms,
        where `encode` holds it 7-9 ms on a 2-core CPU, and every decode step waits for the GIL)."""
        return list(self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_within(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int] | None:
        """`encode(text)`, or None when it is surely longer than `max_tokens`: found by counting the
        tokens of pieces of the text, cut at whitespace, and stopping once their sum is past the limit
        by more than the cuts can add. A text of millions of characters then costs about what a prompt
        that fills the context does, not its whole tokenization."""
        piece = COUNT_PIECE_CHARS_PER_TOKEN * max_tokens
        if len(text) <= 2 * piece:
            return self.encode(text, add_special_tokens)
        counted, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(len(text), start + piece)
            if end < len(text):
                space = text.rfind(" ", start + piece // 2, end)  # a cut before a space splits no word
                end = space if space > start else end
            counted += len(self.encode(text[start:end], add_special_tokens=False))
            start, cuts = end, cuts + 1
            if counted > max_tokens + COUNT_SLACK_TOKENS * cuts:  # a cut adds at most a few tokens
                return None
        return self.encode(text, add_special_tokens)

    def encode_tail(self, text: str, keep: int, add_special_tokens: bool = True) -> list[int]:
        """`encode(text)[-keep:]`, read from tails of the text cut before a space: a tail's last `keep`
        ids are taken once a tail twice as long ends in the same ones (what a cut changes stays at the
        tail's start). A text of millions of characters truncated to `keep` tokens then costs about
        what those tokens do; its whole tokenization (and the GIL held for its list of ids) is spared."""
        chars = COUNT_PIECE_CHARS_PER_TOKEN * (keep + COUNT_SLACK_TOKENS)
        previous: list[int] | None = None
        while chars < len(text):
            start = len(text) - chars
            space = text.find(" ", start, start + chars // 2)  # a cut before a space splits no word
            ids = self.encode(text[space if space >= 0 else start:], add_special_tokens=False)[-keep:]
            if ids == previous and len(ids) == keep:
                return ids
            previous, chars = ids, 2 * chars
        return self.encode(text, add_special_tokens)[-keep:]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatOptions = ChatOptions()) -> str:
        """The chat template's text for `messages` (and the functions it may call), by default ending
        with the assistant's turn opened."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template; send a plain prompt instead")
        try:
            text = self._hf.apply_chat_template([dict(m) for m in messages], tools=tools, tokenize=False,
                                                add_generation_prompt=options.add_generation_prompt,
                                                continue_final_message=options.continue_final_message,
                                                **options.template_kwargs)
        except Exception as e:  # jinja's errors, including the template's own raise_exception
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e
        return str(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids for a chat: the template's text encoded as is (it writes its own BOS)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


class StreamDetokenizer:
    """Turns a token stream into text pieces; a character split across tokens (byte-level BPE)
    comes out whole with the token that completes it, never as U+FFFD halves."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class StopMatcher:
    """Finds stop strings in streamed text, also when one is split across pieces. Text is held
    back only while it could be the start of a stop string; nothing after the first stop string
    found is emitted, nor the stop string itself unless `include_stop`."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("a stop string is empty; every stop string needs at least one character")
        self._stops = tuple(stops)
        self._include = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text that is safe to emit now, whether a stop string was found)."""
        if self.stopped:
            return "", True
        text = self._held + piece
        found = [(i, s) for s, i in ((s, text.find(s)) for s in self._stops) if i >= 0]
        if found:
            self._held, self.stopped = "", True
            at, stop = min(found, key=lambda f: f[0])  # the earliest; of two there, the first listed
            return text[:at + len(stop) if self._include else at], True
        keep = max((n for s in self._stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[len(text) - n:])), default=0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """At the end of a stream without a stop: the text still held back."""
        held, self._held = self._held, ""
        return held
