"""Tool calls on /v1/chat/completions: `tools` are rendered by the checkpoint's chat template, and the
answer's `tool_calls` read from its text (openai_tool_calls.py) by the parser of the template's
family (hermes' `<tool_call>{"name", "arguments"}</tool_call>` for Qwen2.5/Qwen3, Llama 3.x's JSON
`{"name", "parameters"}`). `tool_choice` `required` and a named function are enforced with a JSON
schema built from the tools' parameters (structured outputs), as vLLM does: the answer is then that
JSON (an array of {"name", "parameters"}, or the named function's arguments)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.grammar_spec import GrammarSpec
from serving.validation import InvalidRequest

LLAMA_PYTHON_TAG = "<|python_tag|>"
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tools:
    tools: list[dict[str, Any]]   # as the chat template takes them
    choice: str                   # "auto", "required", or the named function
    named: bool = False
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return dict(function.get("parameters") or {"type": "object"})

    def grammar(self) -> GrammarSpec | None:
        """The schema that `required` or a named function holds the answer to; None for `auto`."""
        if self.named:
            return GrammarSpec("json_schema", json.dumps(self.parameters(self.choice)))
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": self.parameters(t["function"]["name"])},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json_schema", json.dumps(schema))


def read_tools(data: Mapping[str, Any]) -> Tools | None:
    """The request's tools and tool_choice; None when it has none or `tool_choice` is `none`."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if choice is not None and not tools:
        raise InvalidRequest("tool_choice is only allowed when tools are given", "tool_choice")
    if not tools:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be an array of at most {MAX_TOOLS} functions", "tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping) \
                or not isinstance(function.get("name"), str) or not function["name"] \
                or not isinstance(function.get("parameters") or {}, Mapping):
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 "\"parameters\": {...}}}}", "tools")
        names.append(function["name"])
    parallel = data.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice == "auto":
        return Tools(list(tools), "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(list(tools), "required", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, Mapping) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), Mapping) else None
    if name not in names:
        raise InvalidRequest("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}} naming one of the tools", "tool_choice")
    return Tools(list(tools), str(name), named=True, parallel=parallel)


def family_of(template: str) -> str | None:
    """Which parser reads the tool calls of a model with this chat template; None: it takes no tools."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if LLAMA_PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return None
