"""Log probabilities over the OpenAI HTTP API, through the `openai` SDK against a real decode server:
OpenAI's shapes on chat and completions, streamed and not, the same numbers either way, and the
numbers themselves checked against the model's own logits computed here, token by token."""

from __future__ import annotations

import math
from typing import Any

import grpc
import openai
import pytest
import torch
from pd.v1 import decode_pb2, decode_pb2_grpc

from engine.byte_tokenizer import byte_tokenizer
from tests.test_http_fixtures import HttpServer, approx_logprobs
from tests.test_reliability_fixtures import prompt

pytest_plugins = ["tests.test_reliability_fixtures", "tests.test_http_fixtures"]
pytestmark = pytest.mark.e2e  # starts server processes (make test-fast leaves it out)

MODEL = "tiny"


def reference_logprobs(prompt_ids: list[int], answer: list[int], device: str) -> list[torch.Tensor]:
    """log_softmax of the tiny model's logits before each answer token, from whole prefills here, on the
    server's device (a preset's random weights are drawn by that device's generator)."""
    from engine.offline import make_runner

    runner = make_runner(preset="tiny", device=device, max_model_len=256)
    out = []
    for i in range(len(answer)):
        ids = prompt_ids + answer[:i]
        table = runner.pool.allocator.allocate(runner.pool.blocks_needed(len(ids)))
        try:
            out.append(torch.log_softmax(runner.prefill(ids, table, 0).float(), dim=-1))
        finally:
            runner.pool.allocator.free(table)
    return out


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_completion_logprobs_are_the_models(http_server: HttpServer, mode: str) -> None:
    ids = prompt(20, salt=11)
    got = http_server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0.8, seed=5, logprobs=3,
        extra_body={"ignore_eos": True, "prefill_mode": mode, "chunk_size": 16})
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    with grpc.insecure_channel(http_server.address) as ch:  # the same seeded request's token ids
        answer = [r.token_id for r in decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
            token_ids=ids, max_new_tokens=6, ignore_eos=True, sampling=decode_pb2.SamplingParams(
                temperature=0.8, seed=5)), timeout=60)]
    reference = reference_logprobs(ids, answer, http_server.device)
    for i, (token, chosen, top) in enumerate(zip(answer, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert chosen == pytest.approx(float(reference[i][token]), abs=1e-3)  # raw logits: no temperature
        assert max(top.values()) == pytest.approx(float(reference[i].max()), abs=1e-3)
        assert 1 <= len(top) <= 4 and all(v <= 0 for v in top.values())


def test_greedy_chosen_is_the_best_and_streams_match(http_server: HttpServer) -> None:
    client = http_server.client()
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best token
        assert entry.bytes == list(entry.token.encode())
    streamed = [c.choices[0].logprobs.content for c in client.chat.completions.create(stream=True, **args)
                if c.choices and c.choices[0].logprobs is not None]
    assert [e.logprob for chunk in streamed for e in chunk or []] == approx_logprobs([e.logprob for e in content])


def test_logprob_fields_checked(http_server: HttpServer) -> None:
    client = http_server.client()
    no_logprobs = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert no_logprobs.choices[0].logprobs is None
    zero = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=0)
    lp = zero.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 2
    assert all(math.isfinite(v) for v in lp.token_logprobs)
    chat = [{"role": "user", "content": "hi"}]
    for kwargs, param in [(dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21),
                                                                    "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, **kwargs)  # type: ignore[call-overload]
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                  extra_body={"prefill_mode": "disaggregated"})
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "prefill_mode"


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_echo_scores_the_prompt_as_the_model_does(http_server: HttpServer, mode: str) -> None:
    """lm-eval-harness' loglikelihood request: echo, logprobs, one token. Sent twice, so the second
    finds the prompt in the prefix cache, whose blocks would have no logits to give."""
    ids = prompt(40, salt=13)
    reference = reference_logprobs(ids[:1], ids[1:], http_server.device)
    for _ in range(2):
        got = http_server.client().completions.create(model=MODEL, prompt=[ids], max_tokens=1, temperature=0,
                                                      logprobs=1, echo=True,
                                                      extra_body={"prefill_mode": mode, "chunk_size": 16})
        lp = got.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == 41 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i, token in enumerate(ids[1:]):
            assert lp.token_logprobs[i + 1] == pytest.approx(float(reference[i][token]), abs=1e-3), i
        assert got.usage is not None and got.usage.prompt_tokens == 40
    plain = http_server.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=3, echo=True)
    assert plain.choices[0].text.startswith("Once upon") and plain.choices[0].logprobs is None


def test_streamed_echo_sends_the_prompt_first(http_server: HttpServer) -> None:
    """As vLLM streams it: the first event's text is the prompt's and the first token's, its log
    probabilities the prompt's (null for the first token) and the first token's; every choice echoes."""
    client = http_server.client()
    ids = prompt(24, salt=17)
    for fields, echoed in (({"prompt": "Once upon a time", "logprobs": 2}, "Once upon a time"),
                           ({"prompt": [ids]}, byte_tokenizer().decode(ids))):
        args: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True}, **fields)
        whole = client.completions.create(**args).choices[0]
        events = [c.choices[0] for c in client.completions.create(stream=True, **args)]
        assert len(events) == 6 and "".join(e.text for e in events) == whole.text
        assert events[0].text.startswith(echoed) and not events[1].text.startswith(echoed)  # with the first token
        if whole.logprobs is None:
            assert all(e.logprobs is None for e in events)
            continue
        assert events[0].logprobs is not None and events[0].logprobs.token_logprobs is not None
        assert events[0].logprobs.token_logprobs[0] is None and len(events[0].logprobs.token_logprobs) > 2
        for name in ("tokens", "text_offset"):
            assert [v for e in events for v in getattr(e.logprobs, name)] == getattr(whole.logprobs, name), name
        assert [v for e in events for v in e.logprobs.token_logprobs] == approx_logprobs(whole.logprobs.token_logprobs)
        streamed_top = [top or {} for e in events for top in e.logprobs.top_logprobs]
        whole_top = [top or {} for top in whole.logprobs.top_logprobs]
        assert [list(top) for top in streamed_top] == [list(top) for top in whole_top]
        assert [v for top in streamed_top for v in top.values()] == \
            approx_logprobs([v for top in whole_top for v in top.values()])
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, n=2, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    firsts = {c.choices[0].index: c.choices[0].text for c in reversed(chunks)}  # each choice's first event
    assert firsts[0].startswith("Hi") and firsts[1].startswith("Hi")


def test_vllm_prompt_logprobs_rank_the_prompts_tokens(http_server: HttpServer) -> None:
    """vLLM's `prompt_logprobs: k`: None for the first token, then the prompt token's log probability
    and rank among all tokens, beside the k likeliest (ranks 1..k); echo's alternatives stay its own."""
    ids = prompt(24, salt=17)
    reference = reference_logprobs(ids[:1], ids[1:], http_server.device)
    got = http_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, logprobs=1,
                                                  echo=True, extra_body={"prompt_logprobs": 3})
    choice: Any = got.choices[0]
    entries = choice.prompt_logprobs
    assert len(entries) == 24 and entries[0] is None
    for i, token in enumerate(ids[1:]):
        row = reference[i]
        entry = entries[i + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(float(row[token]), abs=1e-3)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        best = torch.topk(row, 3).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2, 3]
        assert set(entry) == {str(t) for t in best} | {str(token)}
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:24])  # echo's logprobs=1: itself and 1
    chat = http_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_entries = getattr(chat, "prompt_logprobs", None) or chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(chat_entries) == chat.usage.prompt_tokens and chat_entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_entries[1:])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs is not supported with stream"):
        http_server.client().completions.create(model=MODEL, prompt=ids, max_tokens=2, stream=True,
                                                extra_body={"prompt_logprobs": 1})
