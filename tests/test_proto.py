"""The committed generated code matches the .proto sources (`make proto` regenerates it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.servers import ROOT

_spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
assert _spec and _spec.loader
proto_generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(proto_generate)
PROTO_ROOT, generate = proto_generate.PROTO_ROOT, proto_generate.generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = PROTO_ROOT / rel
        assert committed.exists(), f"{rel} is not committed; run make proto"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run make proto"
