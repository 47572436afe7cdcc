"""The README's commands, exactly as written. `make demo`, its first, runs in the project's folder as a
fresh clone runs it. The "Running it" commands, read from README.md itself, run in order against servers
started as that section starts them (`make serve-prefill serve-decode`: the tiny model on the CPU,
prefix caches on, the default ports): the scenario, both generate lines, the load, the curl, the
python snippet (while the servers are up, before the block's last command, `make stop`), `make stop`.
Those run in a scratch folder, where out.json, out.png and run/ land: its Makefile includes the
project's. So do the two commands that start the servers by hand. `python` on the PATH is this
interpreter. GPUs are hidden, so the servers start as on a machine without one. The flag table's flags
are each in the `--help` of the servers their row names. The Results section's two commands run too: the
table renderer in a copy of the documents, and `make results`, which without a GPU refuses in one line."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import ROOT

pytestmark = pytest.mark.e2e  # starts server processes

README = ROOT / "README.md"
PORTS = (50051, 50052, 8000, 8001, 8002)  # the Makefile's defaults, which the commands address


def section(title: str) -> str:
    """The README's section under `## title`, up to the next."""
    return README.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def running_it() -> tuple[list[str], str]:
    """The "Running it" section's shell commands (a trailing backslash continues a line) and its python snippet."""
    section_text = section("Running it")
    blocks = re.findall(r"```sh\n(.*?)```", section_text, re.S)
    snippets = re.findall(r"```python\n(.*?)```", section_text, re.S)
    assert len(blocks) == 1 and len(snippets) == 1, "the section's code blocks changed: update this test"
    return re.split(r"(?<!\\)\n", blocks[0].strip()), snippets[0]


def check_scenario(table: Path, plot: Path) -> None:
    """The scenario's six rows: A's tokens its solo run's, each B's first token the reference's (each B
    prefilled, with the caches on); and its plot drawn."""
    rows = json.loads(table.read_text())["rows"]
    assert len(rows) == 6 and all(r["a_tokens_match_solo"] for r in rows)
    assert all(r["b_tokens_match_reference"] for r in rows[1:])
    assert plot.stat().st_size > 10_000


def check_stopped(stdout: str, run_dir: Path) -> None:
    """`make stop`'s output and what it leaves: both servers stopped, no pid file."""
    assert "decode server stopped" in stdout and "prefill server stopped" in stdout
    assert not list(run_dir.glob("*.pid"))


def check(command: str, proc: subprocess.CompletedProcess[str], folder: Path) -> None:
    """What each command must have done, beyond exiting 0."""
    program = command.split("#", 1)[0].split()
    if program[:2] == ["make", "serve-prefill"]:
        assert proc.stdout.count("is SERVING") == 2
    elif program[2:3] == ["client.scenario"]:
        check_scenario(folder / "out.json", folder / "out.png")
    elif program[2:3] == ["client.generate"]:
        assert "finish_reason=" in proc.stdout
    elif program[2:3] == ["client.load"]:
        assert re.search(r"Successful requests:\s+[1-9]", proc.stdout), proc.stdout
    elif program[:1] == ["curl"]:
        assert json.loads(proc.stdout)["choices"][0]["message"]["role"] == "assistant"
    elif program == ["make", "stop"]:
        check_stopped(proc.stdout, folder / "run")
    else:
        raise AssertionError(f"a README command this test does not know how to check: {command!r}")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def scratch_env(tmp_path: Path) -> dict[str, str]:
    """The environment the commands run in: `python` (on PATH) and the Makefile's PYTHON are this
    interpreter, the project and its stubs importable, no GPU visible, and no port of the Makefile's in use."""
    busy = [p for p in PORTS if listening(p)]
    assert not busy, f"ports {busy} are in use: stop what listens there (make stop) and run this test again"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    paths = (str(ROOT), str(ROOT / "proto"), os.environ.get("PYTHONPATH"))
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
            "PYTHONPATH": os.pathsep.join(p for p in paths if p), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_runs_as_written(tmp_path: Path) -> None:
    """The README's first command, in the project's folder as a fresh clone runs it: it installs, starts
    both servers, replays the scenario (every row's tokens identical), prints the table and stops them."""
    opening = re.search(r"```sh\n(.*?)```", README.read_text(), re.S)
    assert opening is not None and opening.group(1).split("\n")[0].split("#")[0].strip() == "make demo"
    env = scratch_env(tmp_path)
    run_dir = ROOT / "run"
    for stale in run_dir.glob("scenario.*"):
        stale.unlink()
    try:
        proc = subprocess.run(["make", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:  # a server left up by a demo that failed to start its pair would hold the next test's ports
        subprocess.run(["make", "stop"], cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    check_scenario(run_dir / "scenario.json", run_dir / "scenario.png")
    check_stopped(proc.stdout, run_dir)
    assert not [p for p in PORTS if listening(p)]


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("curl") is None, reason="needs make and curl")
def test_the_readmes_commands_run_as_written(tmp_path: Path) -> None:
    env = scratch_env(tmp_path)
    commands, snippet = running_it()
    assert commands[0].startswith("make serve-prefill serve-decode") and commands[-1].startswith("make stop")
    (tmp_path / "Makefile").write_text(f"include {ROOT / 'Makefile'}\n")

    def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, cwd=tmp_path, env=env, input=stdin, capture_output=True, text=True, timeout=150)

    try:
        for command in commands[:-1]:
            proc = run(["bash", "-c", command])
            assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
            check(command, proc, tmp_path)
        proc = run([sys.executable, "-"], stdin=snippet)
        assert proc.returncode == 0, proc.stderr  # its text is sampled (temperature 1): it may be empty
    finally:
        stop = run(["bash", "-c", commands[-1]])
    assert stop.returncode == 0, stop.stderr
    check(commands[-1], stop, tmp_path)


def servers_yourself() -> list[str]:
    """The README's other way to start the pair: the two commands of "start the servers yourself with ..."."""
    sentence = re.search(r"start the\s+servers yourself with (`[^`]+`) and (`[^`]+`)", README.read_text())
    assert sentence is not None, "the README's sentence on starting the servers yourself changed: update this test"
    return [sentence.group(1).strip("`"), sentence.group(2).strip("`")]


def test_the_servers_start_by_hand_as_written(tmp_path: Path) -> None:
    """`python -m prefill_server` and `python -m decode_server --prefill-addr 127.0.0.1:50052`, as the README
    writes them: both serve on their default ports, a prompt is prefilled remotely and decoded, and SIGTERM
    stops each with status 0. Their output goes to <module>.log in the scratch folder."""
    import grpc
    from pd.v1 import decode_pb2, decode_pb2_grpc

    from client.wait_ready import is_serving

    env = scratch_env(tmp_path)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command, address in zip(servers_yourself(), ("127.0.0.1:50052", "127.0.0.1:50051"), strict=True):
            with open(tmp_path / f"{command.split()[2]}.log", "wb") as log:  # the child keeps its own handle
                procs.append(subprocess.Popen(shlex.split(command), cwd=tmp_path, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 120
            while not is_serving(address, timeout=0.5):
                assert procs[-1].poll() is None and time.monotonic() < deadline, f"{command}: see {log.name}"
                time.sleep(0.2)
        with grpc.insecure_channel("127.0.0.1:50051") as channel:
            replies = list(decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.GenerateRequest(
                token_ids=[1, 2, 3], max_new_tokens=4, ignore_eos=True,
                prefill_mode=decode_pb2.PREFILL_MODE_DISAGGREGATED), timeout=60))
        assert len(replies) == 4
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in procs]
    assert codes == [0, 0], codes


def flag_table() -> list[tuple[list[str], str]]:
    """The README's flag table: each row's flags (every `--name` in its first column) and its server column."""
    rows = []
    for line in README.read_text().split("| flag | server | what it sets |", 1)[1].split("\n\n", 1)[0].splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "\|" is in a cell
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.append((re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cells[0]), cells[1]))
    return rows


def test_each_flag_in_the_readme_table_is_in_its_servers_help() -> None:
    """The README says `--help` on either server lists them all: every flag of its table is in the --help of
    each server its row names ("both": both; "both / decode" or "both; decode": the row's flags in one or
    the other)."""
    helps = {server: subprocess.run([sys.executable, "-m", f"{server}_server", "--help"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=120, check=True).stdout
             for server in ("prefill", "decode")}
    rows = flag_table()
    assert len(rows) >= 15, "the README's flag table changed shape: update this test"
    for flags, where in rows:
        servers = ["prefill", "decode"] if where == "both" else ["decode"] if where == "decode" else None
        for flag in flags:
            if servers is None:  # a row whose flags are split between the two
                assert any(re.search(rf"{flag}\b", text) for text in helps.values()), (flag, where)
            for server in servers or []:
                assert re.search(rf"{flag}\b", helps[server]), f"{flag} ({where}) is not in {server}_server --help"


def test_the_table_renderer_runs_as_written(tmp_path: Path) -> None:
    """`python -m bench.readme_tables`, as the Results section writes it, in a copy of the documents and their
    results: a figure edited by hand in the copy's README is rendered back from its file, and nothing else
    changes."""
    command = "python -m bench.readme_tables"
    assert f"(`{command}`)" in section("Results"), "the README's renderer command changed: update this test"
    shutil.copy(README, tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "bench" / "results")
    rendered = README.read_text()
    row = re.search(r"^\| decode step, batch 1 \| [^|]+ \|", rendered, re.M)
    assert row is not None
    (tmp_path / "README.md").write_text(rendered.replace(row.group(0), "| decode step, batch 1 | 0.001 ms |", 1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "rewrote: README.md"
    assert (tmp_path / "README.md").read_text() == rendered
    for doc in (ROOT / "docs").glob("*.md"):
        assert (tmp_path / "docs" / doc.name).read_text() == doc.read_text(), doc.name


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_results_without_a_gpu_refuses_in_one_line(tmp_path: Path) -> None:
    """`make results`, as the Results section writes it, where no GPU is visible: it installs, then says in one
    line that the tables need CUDA GPUs, exits non-zero, and leaves every results file as it was."""
    assert "`make results`" in section("Results"), "the README's `make results` changed: update this test"
    results = ROOT / "bench" / "results"
    before = {path.name: path.stat().st_mtime_ns for path in results.iterdir()}
    proc = subprocess.run(["make", "results"], cwd=ROOT, env=scratch_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: no measurement runs on 0 GPU(s); the README's tables need one or two CUDA GPUs"], \
        proc.stderr
    assert {path.name: path.stat().st_mtime_ns for path in results.iterdir()} == before
