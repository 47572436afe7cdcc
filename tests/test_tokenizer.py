"""Text in and out: a checkpoint folder's tokenizer and chat template (offline), characters split
across byte-level tokens, stop strings split across pieces, and the tiny preset's chat template."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.byte_tokenizer import byte_tokenizer
from engine.tokenizer import ChatOptions, ChatTemplateError, StopMatcher, StreamDetokenizer, Tokenizer
from tests.conftest import write_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "漢字 😀?"}]
MULTIBYTE = "naïve 漢字かな 😀🎉 café"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(folder)


def test_chat_template_ids_are_transformers_own(tokenizer: Tokenizer, folder: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert ids == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.render_chat(MESSAGES).endswith("<|im_start|>assistant\n")
    im_start, im_end = (hf.get_vocab()[t] for t in ("<|im_start|>", "<|im_end|>"))
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2  # special tokens, not their spelled-out text
    assert tokenizer.eos_token_ids == (im_end,)


def test_no_chat_template_is_one_clear_error(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plain = tmp_path / "plain"
    write_tokenizer(plain)
    hf = AutoTokenizer.from_pretrained(plain, local_files_only=True)
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template; send a plain prompt"):
        Tokenizer(hf).apply_chat_template(MESSAGES)


def test_no_tokenizer_files_means_no_tokenizer(tmp_path: Path) -> None:
    assert Tokenizer.maybe_from_folder(tmp_path) is None


def splits_a_character(tokenizer: Tokenizer, ids: list[int]) -> bool:
    """Whether some token of `ids` holds only part of a character's UTF-8 bytes."""
    return any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("which", ["trained BPE", "tiny preset bytes"])
def test_stream_never_emits_a_broken_character(which: str, tokenizer: Tokenizer) -> None:
    tok = tokenizer if which == "trained BPE" else byte_tokenizer()
    ids = tok.encode(MULTIBYTE)
    assert splits_a_character(tok, ids)  # the case under test really occurs
    detok = StreamDetokenizer(tok)
    pieces = [detok.step(i) for i in ids]
    assert "".join(pieces) == MULTIBYTE == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # held back while a character was incomplete


def test_stream_skips_special_tokens_and_shows_invalid_bytes_once_known() -> None:
    tok = byte_tokenizer()
    detok = StreamDetokenizer(tok)
    im_end = tok.eos_token_ids[0]
    pieces = [detok.step(i) for i in [*tok.encode("ok"), im_end, 0xFF, *tok.encode("!")]]
    assert "".join(pieces) == "ok\ufffd!" == tok.decode([*tok.encode("ok"), im_end, 0xFF, *tok.encode("!")])


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(("pieces", "stops", "want"), [
    (["Hello", " wor", "ld", "!"], ["world"], ("Hello ", True)),       # split over pieces
    (["ab", "c<", "|e", "nd|>", "zz"], ["<|end|>"], ("abc", True)),
    (["one. ", "two", ". three"], ["two", "one"], ("", True)),          # the earliest stop wins
    (["wor", "m"], ["world"], ("worm", False)),                         # a prefix that did not complete
    (["ww", "world"], ["world"], ("ww", True)),
    (["no stop here"], ["xyz"], ("no stop here", False)),
    (["a", "b"], [], ("ab", False)),
])
def test_stop_strings(pieces: list[str], stops: list[str], want: tuple[str, bool]) -> None:
    assert feed_all(StopMatcher(stops), pieces) == want


def test_stop_matcher_holds_back_only_a_possible_stop() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.feed("text <") == ("text ", False)
    assert matcher.feed("/") == ("", False)
    assert matcher.feed("x") == ("</x", False)
    assert matcher.feed("</s> more") == ("", True)
    assert matcher.feed("after") == ("", True)
    with pytest.raises(ValueError, match="a stop string is empty"):
        StopMatcher(["ok", ""])


def test_stop_string_split_inside_a_character(tokenizer: Tokenizer) -> None:
    """Detokenizer and matcher together: a stop string made of multi-byte characters whose bytes
    are spread over several tokens."""
    ids = tokenizer.encode(MULTIBYTE)
    detok, matcher = StreamDetokenizer(tokenizer), StopMatcher(["かな"])
    assert feed_all(matcher, [detok.step(i) for i in ids]) == ("naïve 漢字", True)


def test_tiny_preset_chats() -> None:
    """The demo's model takes a chat: ChatML special tokens inside its 320-token vocabulary, its
    turn ends with <|im_end|>, and its byte ids are the bytes they always were."""
    import torch

    from engine.loader import build_preset

    tok = build_preset("tiny", torch.device("cpu"), torch.float32).tokenizer
    assert tok is not None and tok.has_chat_template
    ids = tok.apply_chat_template(MESSAGES)
    assert max(ids) < 320 and ids[0] == 258 and ids.count(259) == 2
    assert tok.decode(ids) == "system\nBe brief.\nuser\n漢字 😀?\nassistant\n"
    assert tok.encode("hé") == list("hé".encode())
    assert tok.eos_token_ids == (259,)


def test_encode_within_is_encode_or_refuses_only_what_cannot_fit() -> None:
    tok = byte_tokenizer()
    short = "hello world " * 10
    assert tok.encode_within(short, 1000) == tok.encode(short)
    # counted in pieces (longer than 8 characters a token of the limit) and refused after the first ones
    assert tok.encode_within("ab " * 50_000, 1000) is None
    spaced = "<|reserved_3|> " * 1000  # 2,000 tokens
    assert tok.encode_within(spaced, 1000) is None
    assert tok.encode_within(spaced, 2000) == tok.encode(spaced)
    # 14 characters a token and no space to cut at: cuts split special tokens, and still it fits
    dense = "<|reserved_3|>" * 1000
    assert len(tok.encode(dense)) == 1000
    assert tok.encode_within(dense, 1200) == tok.encode(dense)
    assert tok.encode_within(dense, 1000) == tok.encode(dense)
    assert tok.encode_within(dense, 700) is None


def test_chat_options_reach_the_template() -> None:
    """A Qwen3-style template: `enable_thinking` false writes an empty thought after the opened turn."""
    tok = byte_tokenizer()
    tok.hf.chat_template = tok.chat_template + (
        "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
        "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    opened = tok.render_chat(said)
    assert opened.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.render_chat(said, options=ChatOptions(template_kwargs={"enable_thinking": False})) == \
        opened + "<think>\n\n</think>\n\n"
    assert tok.render_chat(said, options=ChatOptions(add_generation_prompt=False)) == \
        opened.removesuffix("<|im_start|>assistant\n")
    assert tok.render_chat(said, options=ChatOptions(add_generation_prompt=False, continue_final_message=True)) \
        .endswith("<|im_start|>assistant\nHel")


@pytest.mark.parametrize(("stops", "pieces", "out"), [
    (["cd"], ["ab", "c", "de"], "abcd"),          # split across pieces, kept
    (["de", "bc"], ["abcdef"], "abc"),            # the earliest found
    (["abc", "ab"], ["abcd"], "abc"),             # two at one place: the first listed
])
def test_stop_string_included_when_asked(stops: list[str], pieces: list[str], out: str) -> None:
    matcher = StopMatcher(stops, include_stop=True)
    assert "".join(matcher.feed(p)[0] for p in pieces) == out and matcher.stopped


@pytest.mark.parametrize("keep", [1, 7, 100, 5000])
def test_encode_tail_is_the_encodings_last_tokens(tokenizer: Tokenizer, keep: int) -> None:
    """From tails of the text, however long it is: the same ids as the whole text's encoding ends in."""
    words = ["hello", "world,", "the", "tokenizer's", "  spaced", "\n\nnew", "漢字", "😀", "<|im_end|>", "x" * 40]
    rng = random.Random(keep)
    for tok in (tokenizer, byte_tokenizer()):
        for _ in range(5):
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 20_000)))
            assert tok.encode_tail(text, keep) == tok.encode(text)[-keep:]


def bos_tokenizer(folder: Path) -> Tokenizer:
    """The trained BPE tokenizer with a post-processor that puts a BOS first, as Llama's does."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    backend = hf.backend_tokenizer
    bos = "<|endoftext|>"
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, hf.convert_tokens_to_ids(bos))])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>"))


@pytest.mark.parametrize("which", ["trained BPE", "with a BOS", "tiny preset bytes"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_is_transformers_encode(which: str, add_special_tokens: bool, tokenizer: Tokenizer,
                                       folder: Path) -> None:
    """`encode` reads the backend tokenizer directly (it lets the GIL go); its ids stay transformers'."""
    tok = {"trained BPE": tokenizer, "with a BOS": bos_tokenizer(folder), "tiny preset bytes": byte_tokenizer()}[which]
    texts = ["", " ", MULTIBYTE, "Hello <|im_start|>user\nhi<|im_end|> there", "a  b\t\n\nc " * 50, "<|endoftext|>x"]
    for text in texts:
        want = tok.hf.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens) == want, text
    if which == "with a BOS":
        assert tok.encode("x", True)[0] == tok.hf.convert_tokens_to_ids("<|endoftext|>")
