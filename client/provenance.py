"""The commit a recorded result was produced at."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPORT_MARKER = "COMMIT"  # `python -m bench.ab export` writes the commit an exported tree's files are


def git_commit(folder: Path | None = None) -> str:
    """This tree's commit: $PD_COMMIT where the tree travels with a .git of another commit or none, else its
    COMMIT file where it is an export (whose folder may sit inside another checkout, whose HEAD it is not),
    else its short HEAD, else "unknown". With `folder`, that tree's COMMIT file or short HEAD."""
    if folder is None and os.environ.get("PD_COMMIT"):
        return os.environ["PD_COMMIT"]
    marker = (folder or ROOT) / EXPORT_MARKER
    if marker.is_file():
        return marker.read_text().strip()
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder or ROOT,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
