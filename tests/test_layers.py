"""The import rules of pyproject.toml's [tool.importlinter] hold: the engine imports no server,
serving no server, the two servers not each other, no server the client or the launcher, the client
only the proto and itself, and no package has an import cycle."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.servers import ROOT


def test_import_contracts_hold() -> None:
    lint = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    proc = subprocess.run([sys.executable, "-c", lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in proc.stdout  # every contract was read and checked
