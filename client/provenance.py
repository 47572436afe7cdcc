"""The commit a recorded result was produced at."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(folder: Path | None = None) -> str:
    """This checkout's commit: $PD_COMMIT where the tree travels without .git, else its short HEAD, else
    "unknown". With `folder`, that checkout's short HEAD (or "unknown")."""
    if folder is None and os.environ.get("PD_COMMIT"):
        return os.environ["PD_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder or Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"
