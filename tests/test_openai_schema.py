"""read_request, without a server: the fields an OpenAI body turns into, and what each costs the engine."""

from __future__ import annotations

from typing import Any

import pytest

from decode_server.openai_schema import read_request


def fields(body: dict[str, Any]) -> Any:
    api, unknown = read_request({"model": "m", "prompt": "hi", **body}, chat=False, request_id="r", max_items=64)
    assert unknown == []
    return api.fields


@pytest.mark.parametrize(("body", "top", "ranks"), [
    ({}, None, False),
    ({"logprobs": 2}, None, False),                            # the answer's only
    ({"echo": True, "logprobs": 2}, 2, False),                 # echo shows no rank: none is counted
    ({"prompt_logprobs": 1}, 1, True),                         # vLLM's field shows each token's rank
    ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 3, True),
])
def test_prompt_ranks_are_counted_only_where_shown(body: dict[str, Any], top: int | None, ranks: bool) -> None:
    got = fields(body)
    assert (got.prompt_logprobs, got.prompt_ranks) == (top, ranks)
