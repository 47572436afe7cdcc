"""vLLM's fields that shape a prompt or an answer's text, honoured over HTTP: include_stop_str_in_output,
skip_special_tokens, return_tokens_as_token_ids, truncate_prompt_tokens, and a chat's
add_generation_prompt, continue_final_message and chat_template_kwargs; each checked against what
the same request without the field gives."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine.byte_tokenizer import IM_START, byte_tokenizer
from tests.test_http_fixtures import HttpServer
from tests.test_reliability_fixtures import prompt

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"
IM_START_ID = byte_tokenizer().encode(IM_START, add_special_tokens=False)[0]
CONTEXT = 40960


def complete(server: HttpServer, stream: bool = False, **fields: Any) -> tuple[str, Any]:
    """The text of one greedy completion (its events joined when streamed), and the whole response."""
    client = server.client()
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "temperature": 0, **fields}
    if not stream:
        whole = client.completions.create(**args)
        return whole.choices[0].text, whole
    chunks = list(client.completions.create(stream=True, **args))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_kept_with_include_stop_str_in_output(http_server: HttpServer, stream: bool) -> None:
    ids = prompt(24, salt=53)
    full, _ = complete(http_server, prompt=ids, extra_body={"ignore_eos": True})
    at = next(i for i in range(3, len(full)) if full.find(full[i]) == i)  # a character first seen after 3 others
    stop = full[at]
    cut, _ = complete(http_server, stream, prompt=ids, stop=[stop], extra_body={"ignore_eos": True})
    kept, _ = complete(http_server, stream, prompt=ids, stop=[stop],
                       extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert (cut, kept) == (full[:at], full[:at + 1])


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_written_when_not_skipped(http_server: HttpServer, stream: bool) -> None:
    forced = {"logit_bias": {str(IM_START_ID): 100}, "extra_body": {"ignore_eos": True}}  # every token <|im_start|>
    skipped, _ = complete(http_server, stream, prompt=prompt(8), max_tokens=3, **forced)
    written, _ = complete(http_server, stream, prompt=prompt(8), max_tokens=3,
                          **{**forced, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    assert (skipped, written) == ("", IM_START * 3)


def test_logprob_tokens_as_token_ids(http_server: HttpServer) -> None:
    ids = prompt(12, salt=59)
    _, named = complete(http_server, prompt=ids, max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    _, as_ids = complete(http_server, prompt=ids, max_tokens=4, logprobs=2,
                         extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    tokenizer = byte_tokenizer()
    tokens = as_ids.choices[0].logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens)
    # the same tokens, each named by its id
    assert [tokenizer.backend.decode([int(t.split(":")[1])], skip_special_tokens=False) for t in tokens] == \
        named.choices[0].logprobs.tokens
    assert all(k.startswith("token_id:") for top in as_ids.choices[0].logprobs.top_logprobs for k in top)


def test_truncated_prompt_is_its_last_tokens(http_server: HttpServer) -> None:
    ids = prompt(40, salt=61)
    alone, whole_alone = complete(http_server, prompt=ids[-10:], extra_body={"ignore_eos": True})
    cut, whole = complete(http_server, prompt=ids, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 10})
    assert cut == alone and whole.usage.prompt_tokens == whole_alone.usage.prompt_tokens == 10
    echoed, _ = complete(http_server, prompt="0123456789" * 3, max_tokens=1, echo=True,
                         extra_body={"truncate_prompt_tokens": 5})
    assert echoed.startswith("56789") and not echoed.startswith("0123")  # the echo is the prompt as it was cut
    # a text that encodes past the context is taken once it is cut to fit
    long_text = "ab" * (CONTEXT // 2 + 100)
    with pytest.raises(openai.BadRequestError):
        complete(http_server, prompt=long_text, max_tokens=1)
    _, taken = complete(http_server, prompt=long_text, max_tokens=1, extra_body={"truncate_prompt_tokens": 16})
    assert taken.usage.prompt_tokens == 16
    with pytest.raises(openai.BadRequestError) as caught:  # -1 keeps a whole context: no room for an answer
        complete(http_server, prompt=long_text, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert "no room" in caught.value.message or "context" in caught.value.message


@pytest.mark.parametrize("value", [0, -2, 2**31, "4", True])
def test_truncate_prompt_tokens_checked(http_server: HttpServer, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        complete(http_server, prompt=prompt(8), extra_body={"truncate_prompt_tokens": value})
    assert caught.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def chat_prompt_tokens(server: HttpServer, messages: list[dict[str, str]], **fields: Any) -> int:
    whole = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                                     extra_body=fields)
    assert whole.usage is not None
    return whole.usage.prompt_tokens


def test_chat_template_options(http_server: HttpServer) -> None:
    """The tiny template: `<|im_start|>role\\ncontent<|im_end|>\\n` a message (bytes are tokens), then
    `<|im_start|>assistant\\n` (11 tokens) where the turn is opened."""
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    closed = chat_prompt_tokens(http_server, said, add_generation_prompt=False)
    assert chat_prompt_tokens(http_server, said) == closed + 1 + len("assistant\n")
    assert chat_prompt_tokens(http_server, said, continue_final_message=True) == closed - 2  # ends "...Hel"
    assert chat_prompt_tokens(http_server, said, chat_template_kwargs={"enable_thinking": False}) == closed + 11


@pytest.mark.parametrize(("fields", "param"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"big": "x" * 9000}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"add_generation_prompt": 1}, "add_generation_prompt"),
    ({"echo": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, "echo"),
])
def test_chat_template_options_checked(http_server: HttpServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat_prompt_tokens(http_server, [{"role": "user", "content": "hi"}], **fields)
    assert caught.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_count_each_choices_tokens(http_server: HttpServer, chat: bool) -> None:
    client = http_server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    common: dict[str, Any] = dict(model=MODEL, max_tokens=5, n=2, temperature=1.0, seed=3, stream=True,
                                  stream_options=options, extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **common))
    else:
        chunks = list(client.completions.create(prompt=prompt(10, salt=67), **common))
    *events, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 10
    counts: dict[int, list[int]] = {0: [], 1: []}
    for event in events:
        assert event.usage is not None and event.usage.prompt_tokens == last.usage.prompt_tokens
        assert event.usage.total_tokens == event.usage.prompt_tokens + event.usage.completion_tokens
        counts[event.choices[0].index].append(event.usage.completion_tokens)
    assert counts == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}  # each choice's own, a token an event


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True}, {"include_usage": True, "something": 1}])
def test_stream_options_checked(http_server: HttpServer, options: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        args: dict[str, Any] = {"model": MODEL, "prompt": prompt(8), "max_tokens": 2, "stream_options": options}
        list(http_server.client().completions.create(stream=True, **args))
    assert caught.value.body["param"] == "stream_options"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_the_continued_message_first(http_server: HttpServer, stream: bool) -> None:
    """vLLM's chat `echo`: the last message's text before the answer's, where it is the assistant's."""
    client = http_server.client()
    said: list[Any] = [{"role": "user", "content": "a story"}, {"role": "assistant", "content": "Once upon"}]
    args: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={
        "continue_final_message": True, "ignore_eos": True})
    plain = client.chat.completions.create(messages=said, **args).choices[0].message.content

    def answer(messages: list[Any]) -> str:
        echoed: dict[str, Any] = {**args, "extra_body": {**args["extra_body"], "echo": True}}
        if not stream:
            return client.chat.completions.create(messages=messages, **echoed).choices[0].message.content or ""
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **echoed))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert answer(said) == "Once upon" + (plain or "")
    asked = [said[0]]  # the last message is the user's: nothing to echo
    assert answer(asked) == client.chat.completions.create(messages=asked, **args).choices[0].message.content
