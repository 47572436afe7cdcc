"""Regenerate the Python code for proto/pd/v1/*.proto (`make proto`)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
SOURCES = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pd" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc  # only needed to regenerate

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *SOURCES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT)
