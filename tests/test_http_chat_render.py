"""Large chats are rendered and tokenized in the render pool's worker process
(`decode_server/chat_render_pool.py`); their prompt must be the one the template gives here, and
a chat the context can't hold is refused there, as it is in the server's own process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest

from engine.byte_tokenizer import byte_tokenizer
from tests.test_http_api import post as http_post
from tests.test_http_fixtures import HttpServer

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"


def children_pids(pid: int) -> list[tuple[str, str]]:
    """A process's children (Linux's /proc): (pid, command line) each."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found.append((child, (Path("/proc") / child / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
    return found


def children(pid: int) -> list[str]:
    return [cmdline for _, cmdline in children_pids(pid)]


def test_a_large_chat_is_the_templates_prompt(http_server: HttpServer) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "ab" * (i % 5)}
                for i in range(300)]  # more than the server renders in its own process
    client = http_server.client()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                          extra_body={"ignore_eos": True})
    ids = byte_tokenizer().apply_chat_template(messages)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert http_server.proc is not None
    assert any("spawn_main" in cmdline for cmdline in children(http_server.proc.pid))  # the pool's worker
    small = client.chat.completions.create(model=MODEL, messages=messages[-3:], max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True})
    assert small.usage is not None and small.usage.prompt_tokens == len(byte_tokenizer().apply_chat_template(
        messages[-3:]))  # rendered in the server's own process


def test_a_large_chat_past_the_context_is_400(http_server: HttpServer) -> None:
    messages = [{"role": "user", "content": "x" * 20_000}] * 20  # 400k characters, a byte-level token each
    with pytest.raises(openai.BadRequestError) as caught:
        http_server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "messages"
    assert "encodes to more than the context limit of 40960" in caught.value.body["message"]


def test_a_killed_render_worker_is_replaced(http_server: HttpServer) -> None:
    """The worker killed between two large chats: the second is still answered, by a new worker."""
    messages = [{"role": "user", "content": f"m{i}"} for i in range(300)]
    client = http_server.client()

    def ask() -> str:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
                                              extra_body={"ignore_eos": True}).choices[0].message.content or ""

    first = ask()
    assert http_server.proc is not None
    workers = [int(pid) for pid, cmdline in children_pids(http_server.proc.pid) if "spawn_main" in cmdline]
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    assert ask() == first
    assert "the chat render worker had stopped; starting another" in http_server.log()


def test_a_large_chat_that_is_not_json_is_400(http_server: HttpServer) -> None:
    """Read in the worker, a broken body gets the refusal one read here gets."""
    body = b'{"messages": [' + b'{"role": "user", "content": "x"},' * 10_000 + b"]"  # over 256 KiB, cut short
    status, reply = http_post(http_server, "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["code"] == "invalid_json", reply
    assert "not valid JSON" in reply["error"]["message"]


def test_the_render_worker_loads_no_torch(http_server: HttpServer) -> None:
    """The server's render worker, once it has rendered a chat, has neither torch nor xgrammar loaded
    (with them it took 3.2 s to start instead of 0.8, and 436 MB instead of 86)."""
    messages = [{"role": "user", "content": f"m{i}"} for i in range(300)]
    http_server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert http_server.proc is not None
    workers = [pid for pid, cmdline in children_pids(http_server.proc.pid) if "spawn_main" in cmdline]
    assert workers
    for pid in workers:
        maps = (Path("/proc") / pid / "maps").read_text()
        assert "libtorch" not in maps and "xgrammar" not in maps
