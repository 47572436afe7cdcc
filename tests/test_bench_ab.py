"""`python -m bench.ab`: a commit's files exported as a tree, and one command run on trees in alternation,
each in its own folder and naming its own commit, with the figures read back from each run's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ab

# a benchmark stand-in: its figure is the tree's VALUE file; it logs the order runs came in
PROBE = """
import json, os, sys
from pathlib import Path
value = float(Path("VALUE").read_text())
with open(os.environ["AB_LOG"], "a") as log:
    log.write(Path.cwd().name + "\\n")
Path(sys.argv[1]).write_text(json.dumps({"ms": {"1": value, "64": value * 2}, "rate": value * 10,
                                         "commit": os.environ["PD_COMMIT"], "command": " ".join(sys.argv)}))
"""


def _tree(root: Path, name: str, value: float, commit: str | None) -> Path:
    tree = root / name
    tree.mkdir()
    (tree / "probe.py").write_text(PROBE)
    (tree / "VALUE").write_text(str(value))
    if commit:
        (tree / "COMMIT").write_text(commit + "\n")
    return tree


def test_export_writes_the_commits_tracked_files(tmp_path: Path) -> None:
    folder = ab.export("HEAD", tmp_path)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ab.REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert (folder / "COMMIT").read_text().strip() == head == ab.tree_commit(folder)
    tracked = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "bench"], cwd=ab.REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    assert tracked and all((folder / name).is_file() for name in tracked)
    assert (folder / "bench" / "common.py").read_bytes() == subprocess.run(
        ["git", "show", "HEAD:bench/common.py"], cwd=ab.REPO, capture_output=True, check=True).stdout


def test_a_benchmark_run_inside_an_export_records_the_exports_commit(tmp_path: Path) -> None:
    """An export sits inside the checkout (.ab/REV), whose git HEAD is another commit: a benchmark run there
    directly, not through `run`, records the export's COMMIT, not the checkout's HEAD."""
    folder = tmp_path / "tree"
    (folder / "client").mkdir(parents=True)
    (folder / "client" / "provenance.py").write_bytes((ab.REPO / "client" / "provenance.py").read_bytes())
    (folder / "COMMIT").write_text("abc1234\n")
    probe = "import client.provenance as p; print(p.git_commit())"
    env = {k: v for k, v in os.environ.items() if k != "PD_COMMIT"}
    got = subprocess.run([sys.executable, "-c", probe], cwd=folder, env={**env, "PYTHONPATH": str(folder)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == "abc1234"


def test_runs_alternate_and_each_names_its_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    before, after = _tree(tmp_path, "before", 2.0, "aaaaaaa"), _tree(tmp_path, "after", 1.5, "bbbbbbb")
    log = tmp_path / "order.log"
    monkeypatch.setenv("AB_LOG", str(log))
    record = tmp_path / "record.json"
    ab.main(["run", "--trees", str(before), str(after), "--rounds", "2", "--keys", "ms", "rate", "missing",
             "--json", str(record), "--", sys.executable, "probe.py", "{json}"])
    assert log.read_text().split() == ["before", "after", "before", "after"]
    doc = json.loads(record.read_text())
    assert [r["commit"] for r in doc["runs"]] == ["aaaaaaa", "bbbbbbb"] * 2
    assert [r["output"]["commit"] for r in doc["runs"]] == ["aaaaaaa", "bbbbbbb"] * 2  # PD_COMMIT reached it
    assert {r["output"]["command"] for r in doc["runs"]} == {"probe.py {json}"}  # not the run's scratch file
    assert doc["runs"][1]["figures"] == {"ms.1": 1.5, "ms.64": 3.0, "rate": 15.0, "missing": None}
    assert doc["trees"] == [{"tree": str(before), "commit": "aaaaaaa"}, {"tree": str(after), "commit": "bbbbbbb"}]
    printed = capsys.readouterr().out
    assert "| ms.64 | 4 / 4 | 3 / 3 |" in printed and "| missing | - / - | - / - |" in printed


def test_a_failing_run_stops_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad = _tree(tmp_path, "good", 1.0, "ccccccc"), _tree(tmp_path, "bad", 1.0, "ddddddd")
    (bad / "VALUE").write_text("not a number")
    monkeypatch.setenv("AB_LOG", str(tmp_path / "order.log"))
    with pytest.raises(SystemExit, match="bad: the command exited 1"):
        ab.main(["run", "--trees", str(good), str(bad), "--", sys.executable, "probe.py", "{json}"])


def test_refusals_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ab.main(["run", "--trees", str(tmp_path / "absent"), "--", "true"])
    assert "no such tree" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="put {json} where the command writes it"):
        ab.main(["run", "--trees", str(tmp_path), "--keys", "ms", "--", "true"])
