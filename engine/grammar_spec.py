"""What a request asks its output to follow (a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar), as the front ends read it; compiled by `engine.grammar`. Kept apart from
xgrammar and torch so that the request readers (the HTTP API's render worker among them) import
neither."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """The grammar does not compile: a bad schema, regex or EBNF."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to follow; `text`: the schema (JSON), regex, EBNF, or the
    choices as a JSON array."""

    kind: str
    text: str = ""

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    def ebnf(self) -> str:
        """A choice's grammar: one string literal per choice (JSON escapes are EBNF's)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.text))
