"""Print the project's runtime dependencies except torch, one a line.

The image keeps the CUDA build of torch that its base image ships; everything else comes from
pyproject.toml, so the image and `pip install -e .` never disagree on versions.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

KEPT_FROM_BASE_IMAGE = {"torch"}


def requirement_name(spec: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", spec.strip())
    if match is None:
        raise ValueError(f"not a requirement: {spec!r}")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if requirement_name(d) not in KEPT_FROM_BASE_IMAGE]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("pyproject.toml")
    print("\n".join(runtime_requirements(path)))
