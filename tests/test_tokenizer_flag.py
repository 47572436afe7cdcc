"""`--tokenizer FOLDER` (vLLM's flag): a preset or checkpoint reads text with that folder's tokenizer;
a folder without one, or one naming ids past the model's vocabulary, is refused at start in one line."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from engine.loader import ModelLoadError, load_tokenizer
from launcher.process import ServerFailed
from tests.test_http_fixtures import HttpServer

pytest_plugins = ["tests.test_reliability_fixtures"]

WORDS = {"[UNK]": 0, "hello": 7, "world": 9}


def word_tokenizer(folder: Path, vocab: dict[str, int]) -> Path:
    """A word-level tokenizer: "hello world" is [7, 9], where the tiny preset's own reads bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_refused_without_files_or_past_the_vocabulary(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    wide = word_tokenizer(tmp_path / "wide", {**WORDS, "far": 400})
    for folder, expected in ((empty, "no tokenizer files there"),
                             (wide, "ids up to 400, past the model's vocabulary of 320")):
        with pytest.raises(ModelLoadError) as e:
            load_tokenizer(str(folder), 320)
        assert expected in str(e.value) and str(folder) in str(e.value) and "\n" not in str(e.value)
    assert load_tokenizer(str(word_tokenizer(tmp_path / "words", WORDS)), 320).encode("hello world") == [7, 9]


@pytest.mark.e2e
def test_server_reads_text_with_the_folders_tokenizer(tmp_path: Path, server_logs: Path) -> None:
    folder = word_tokenizer(tmp_path / "words", WORDS)
    server = HttpServer(server_logs, "--preset", "tiny", "--tokenizer", str(folder)).start(timeout=120)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/tokenize", method="POST",
                                         data=json.dumps({"prompt": "hello world"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["tokens"] == [7, 9]
        answer = server.client().completions.create(model="tiny", prompt="hello world", max_tokens=2, temperature=0)
        assert answer.usage is not None and answer.usage.prompt_tokens == 2
    finally:
        server.stop()


@pytest.mark.e2e
def test_server_exits_at_start_on_a_folder_without_one(tmp_path: Path, server_logs: Path) -> None:
    server = HttpServer(server_logs, "--preset", "tiny", "--tokenizer", str(tmp_path))
    with pytest.raises(ServerFailed, match="exited with 2 before it was ready"):
        server.start(timeout=120)
    lines = [line for line in server.log().splitlines() if "no tokenizer files there" in line]
    assert len(lines) == 1 and str(tmp_path) in lines[0]
