"""The prefill side's map of NIXL peers (tests/nixl_peer_cases.py), in a process of its own: the prefill
server's metrics module registers the metric names the decode server's does, and a process holds one of
each name (both are imported by the rest of the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_peer_map_in_a_process_of_its_own() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/nixl_peer_cases.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout
