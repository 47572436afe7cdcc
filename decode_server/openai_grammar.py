"""Structured-output fields of the OpenAI API (`response_format`) and vLLM's (`structured_outputs`,
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) read into one `GrammarSpec`; a
request may ask for one grammar at most. Whether it compiles is checked by the request parser."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engine.grammar_spec import GrammarSpec
from serving.validation import InvalidRequest

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_GRAMMAR_CHARS = 65536  # of a schema, regex or grammar as JSON text
MAX_CHOICES = 256
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


def read_grammar(data: Mapping[str, Any]) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the field that asked for it; None for none."""
    asked = [(name, data[name]) for name in FIELDS if data.get(name) is not None]
    specs = [(spec, name) for name, value in asked if (spec := _spec(name, value)) is not None]
    if len(specs) > 1:
        raise InvalidRequest(f"{specs[0][1]} and {specs[1][1]} both ask for a structured output; send one",
                             specs[1][1])
    return specs[0] if specs else None


def _spec(name: str, value: Any) -> GrammarSpec | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, Mapping):
            raise InvalidRequest("structured_outputs must be an object", name)
        given = {k: v for k, v in value.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_KEYS))
        if unknown:
            raise InvalidRequest(f"structured_outputs.{unknown[0][:64]} is not supported; use one of "
                                 f"{', '.join(STRUCTURED_KEYS)}", name)
        if len(given) != 1:
            raise InvalidRequest(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KEYS)}", name)
        key, inner = next(iter(given.items()))
        kind = STRUCTURED_KEYS[key]
        if kind == "json_object":
            return GrammarSpec("json_object")
        return _typed(kind, inner, f"{name}.{key}", name)
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}[name]
    return _typed(kind, value, name, name)


def _response_format(value: Any) -> GrammarSpec | None:
    name = "response_format"
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping) or not isinstance(inner.get("schema", {}), Mapping):
            raise InvalidRequest("response_format.json_schema must be an object holding a schema object", name)
        return _typed("json_schema", inner.get("schema", {}), f"{name}.json_schema.schema", name)
    raise InvalidRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {...}}", name)


def _typed(kind: str, value: Any, shown: str, name: str) -> GrammarSpec:
    """A JSON schema (object, or its JSON text), a regex or grammar (text), or choices (strings)."""
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES \
                or any(not isinstance(c, str) or not c for c in value):
            raise InvalidRequest(f"{shown} must be an array of 1 to {MAX_CHOICES} non-empty strings", name)
        spec = GrammarSpec.choice(value)
    elif kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise InvalidRequest(f"{shown} is not valid JSON", name) from None
        if not isinstance(value, Mapping):
            raise InvalidRequest(f"{shown} must be a JSON schema object", name)
        spec = GrammarSpec(kind, json.dumps(value))
    else:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{shown} must be a non-empty string", name)
        spec = GrammarSpec(kind, value)
    if len(spec.text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{shown} is {len(spec.text)} characters; the limit is {MAX_GRAMMAR_CHARS}", name)
    return spec
