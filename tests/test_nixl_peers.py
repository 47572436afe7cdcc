"""The prefill side's NIXL pairings with real agents (tests/nixl_peer_cases.py), in a process of its own:
the prefill server's metrics module registers the metric names the decode server's does, and a process
holds one of each name (both are imported by the rest of the suite); NIXL is never loaded here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.transport.nixl import nixl_available

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_the_pairings_in_a_process_of_their_own() -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/nixl_peer_cases.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed" in done.stdout, done.stdout
