"""Every code name the docs put in backticks still exists in the tree: file paths, module paths
(`bench.micro.gemv`, `prefill_server.kv_lease`), classes and their members (`DecodeCore.accept`),
and snake_case identifiers. A rename that leaves a doc behind fails here, naming the doc and the name."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Folders of this checkout that are not the tree: the environment, build output, git, and the trees
# `python -m bench.ab export` writes (other commits' files, whose names the docs must not lean on)
SCRATCH = {".venv", "build", ".git", ".ab"}
SOURCES = [p for p in ROOT.rglob("*.py")
           if not (SCRATCH & set(p.relative_to(ROOT).parts)) and p != Path(__file__).resolve()]
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))

# Names the docs use from other projects and libraries (and protocol words), not from this tree.
EXTERNAL = {
    "AioRpcError", "CUDAOptions", "OpenAI", "ThreadPoolExecutor", "NetworkPolicy", "PyTorch", "LLMEngine",
    "MemPool", "set_context()", "pop_context()",  # torch.cuda's memory pools and green contexts
    "cuda_ipc", "libuct_ib_efa", "show_gids",  # UCX's transport and library names, and an RDMA tool
}

CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+(\(\))?$")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+(\(\))?$")
FILE_LIKE = re.compile(r"^[\w.*-]+(/[\w.*-]*)*\.(py|md|json|proto|yaml|toml|png|pyi)$|^[\w.-]+(/[\w.*-]+)*/$")


@cache
def _file_names(path: Path) -> frozenset[str]:
    """The names one Python file binds or spells as a string (metric names, JSON keys, fields)."""
    names: set[str] = set()
    try:
        tree = ast.parse(path.read_text())
    except (SyntaxError, UnicodeDecodeError):
        return frozenset()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if all(part.isidentifier() for part in node.value.split(".")):  # a logger's name among them
                names.add(node.value)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[-1])
    return frozenset(names)


@cache
def _defined() -> frozenset[str]:
    """Every name the tree's Python binds or spells as a string, and every name its protos define."""
    names: set[str] = set(PACKAGES)
    for path in SOURCES:
        names.update(_file_names(path))
    for proto in PROTOS:
        names.update(re.findall(r"\b(?:message|service|rpc|enum)\s+(\w+)", proto.read_text()))
        names.update(re.findall(r"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+", proto.read_text(), re.M))
    return frozenset(names)


@cache
def _members(class_name: str) -> frozenset[str] | None:
    """The names a class of the tree binds in its body (methods, attributes set on self); None if no class has it."""
    found: set[str] | None = None
    for path in SOURCES:
        text = path.read_text()
        if f"class {class_name}" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                found = found or set()
                for inner in ast.walk(node):
                    if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        found.add(inner.name)
                    elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                        found.add(inner.attr)
                    elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        found.add(inner.id)
    return None if found is None else frozenset(found)


def _module(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest leading run of `parts` that is a module or package of the tree, and the rest."""
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path, parts[n:]
    return None


def _problem(name: str, doc: Path) -> str | None:
    """Why `name` names nothing in the tree; None if it does, or if it is not a name this test checks."""
    name = name.strip()
    if name in EXTERNAL or " " in name or name.startswith(("-", "/", "http", "$", "~")):
        return None
    if FILE_LIKE.match(name) and ("/" in name or "." in name.rsplit("/", 1)[-1]):
        if "*" in name:
            return None if list(ROOT.glob(name)) or list(ROOT.rglob(name)) else "no file matches"
        if (ROOT / name).exists() or (doc.parent / name).exists():
            return None
        if "/" not in name.rstrip("/"):  # a bare file name: a source file anywhere in the tree
            return None if not name.endswith(".py") or any(True for _ in ROOT.rglob(name)) else "no such file"
        return None if name.split("/")[0] not in {p.name for p in ROOT.iterdir()} - SCRATCH else "no such file"
    bare = name.removesuffix("()")
    if DOTTED.match(name):
        parts = bare.split(".")
        if parts[0] in PACKAGES and bare not in _defined():
            found = _module(parts)
            if found is None:
                return "no such module"
            path, rest = found
            if rest and rest[0] not in _file_names(path):
                if path.name == "__init__.py":
                    return "no such module"
                return f"{path.relative_to(ROOT)} defines no {rest[0]}"
            return None
        if CAMEL.match(parts[0]) or parts[0] in _defined():
            members = _members(parts[0])
            if members is None:
                return None if parts[0] in _defined() or parts[0] in EXTERNAL else "no such class"
            return None if parts[1] in members else f"{parts[0]} has no {parts[1]}"
        return None
    if CAMEL.match(bare):
        return None if bare in _defined() else "no such class or name"
    if SNAKE.match(name):  # a counter's samples end in _total, which prometheus_client adds
        return None if bare in _defined() or bare.removesuffix("_total") in _defined() else "no such name"
    return None


def _spans(doc: Path) -> list[str]:
    return CODE_SPAN.findall(FENCE.sub("", doc.read_text()))


def test_the_checker_sees_a_stale_name() -> None:
    """The check itself: names that exist pass, and the kinds of stale name the docs once had fail."""
    doc = ROOT / "docs" / "architecture.md"
    assert _problem("DecodeCore.accept", doc) is None and _problem("bench.micro.gemv", doc) is None
    assert _problem("decode_server/scheduler.py", doc) is None and _problem("../bench/NOTES.md", doc) is None
    assert _problem("_publish_prompt", doc) == "no such name"
    assert _problem("Generation.tokens", doc) == "Generation has no tokens"
    assert _problem("bench.sim_costs", doc) == "no such module"
    assert _problem("bench/engine.py", doc) == "no such file"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_backticked_name_in_the_docs_exists(doc: Path) -> None:
    stale = sorted({f"`{name}`: {why}" for name in _spans(doc) if (why := _problem(name, doc))})
    assert not stale, f"{doc.relative_to(ROOT)} names what the tree no longer has:\n" + "\n".join(stale)
