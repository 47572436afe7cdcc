"""`python -m bench.ab`: one benchmark command run on two or more trees in alternation (A, B, A, B), so a
change is measured against the tree before it on the same card, at the same clocks, in one call.

    python -m bench.ab export 8281953       # .ab/8281953/: that commit's files, to carry where git is not
    python -m bench.ab run --trees . .ab/8281953 --rounds 2 --keys decode_ms prefill_ms \\
        --json bench/results/NAME-ab-h200.json -- \\
        python -m bench.micro.engine_steps --preset qwen2.5-7b-fp8 --batches 1 64 --json {json}

Each run's working directory and first import path is its tree, and `PD_COMMIT` names the tree's commit
(its `COMMIT` file, written by `export`, or git's HEAD), so the benchmark records it. `{json}` in the
command is replaced by a file of that run's own; `--keys` names the figures read back from it (a
top-level key, or a dotted path into it: `decode_ms.64`), printed tree beside tree and recorded with
every run's whole output (its `command` naming that file `{json}`, not the scratch file it was).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO, metadata, write_json
from client.provenance import EXPORT_MARKER, git_commit

EXPORTS = REPO / ".ab"  # gitignored: exported trees travel as carried paths


def export(rev: str, into: Path = EXPORTS) -> Path:
    """`rev`'s tracked files (git archive) in `into`/<rev>, with a COMMIT file naming its short hash."""
    commit = _git("rev-parse", "--short", f"{rev}^{{commit}}")
    folder = into / rev.replace("/", "-")
    folder.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    (folder / EXPORT_MARKER).write_text(commit + "\n")
    print(f"{rev} ({commit}) -> {folder}")
    return folder


def tree_commit(tree: Path) -> str:
    """The commit a tree's files are: its COMMIT file (an export), else its checkout's HEAD."""
    return git_commit(None if tree.resolve() == REPO else tree)


def pick(doc: Any, key: str) -> Any:
    """`key`'s value in a run's JSON: dotted parts walk dicts (and list indices); None where it is absent."""
    for part in key.split("."):
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            return None
    return doc


def figures(doc: Any, keys: list[str]) -> dict[str, Any]:
    """The named figures, a dict of numbers flattened one level (`decode_ms.64`)."""
    out: dict[str, Any] = {}
    for key in keys:
        value = pick(doc, key)
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, (dict, list))})
        else:
            out[key] = value
    return out


def run(trees: list[Path], command: list[str], rounds: int, keys: list[str],
        timeout: float | None) -> list[dict[str, Any]]:
    """The command on each tree in turn, `rounds` times over; each run's figures and whole JSON output."""
    if not any("{json}" in part for part in command) and keys:
        raise SystemExit("--keys reads the command's JSON: put {json} where the command writes it")
    runs = []
    with tempfile.TemporaryDirectory(prefix="ab-") as scratch:
        for round_ in range(rounds):
            for i, tree in enumerate(trees):
                out = Path(scratch) / f"run-{round_}-{i}.json"
                argv = [part.replace("{json}", str(out)) for part in command]
                env = {**os.environ, "PD_COMMIT": tree_commit(tree),
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(tree.resolve()), os.environ.get("PYTHONPATH")]))}
                print(f"[round {round_ + 1}/{rounds}, {tree} ({env['PD_COMMIT']})] {shlex.join(argv)}", flush=True)
                done = subprocess.run(argv, cwd=tree, env=env, timeout=timeout)
                if done.returncode != 0:
                    raise SystemExit(f"{tree}: the command exited {done.returncode}; no comparison is made")
                doc = json.loads(out.read_text()) if out.exists() else None
                if isinstance(doc, dict) and isinstance(doc.get("command"), str):  # the scratch file, as {json}
                    doc["command"] = doc["command"].replace(str(out), "{json}")
                runs.append({"tree": str(tree), "commit": env["PD_COMMIT"], "round": round_ + 1,
                             "figures": figures(doc, keys), "output": doc})
    return runs


def table(runs: list[dict[str, Any]], trees: list[Path]) -> str:
    """Figures down, trees across: each tree's values round by round."""
    names = list(dict.fromkeys(name for r in runs for name in r["figures"]))
    heads = [f"{tree} ({next(r['commit'] for r in runs if r['tree'] == str(tree))})" for tree in trees]
    lines = ["| figure | " + " | ".join(heads) + " |", "|---" * (len(trees) + 1) + "|"]
    for name in names:
        cells = [" / ".join(_cell(r["figures"].get(name)) for r in runs if r["tree"] == str(tree)) for tree in trees]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="a commit's files into .ab/<rev>/")
    ex.add_argument("revs", nargs="+")
    ex.add_argument("--into", type=Path, default=EXPORTS)
    ru = sub.add_parser("run", help="a command on each tree in alternation")
    ru.add_argument("--trees", type=Path, nargs="+", required=True, help="folders: . and exports")
    ru.add_argument("--rounds", type=int, default=2)
    ru.add_argument("--keys", nargs="*", default=[], help="figures in the command's {json}: key or dotted.path")
    ru.add_argument("--timeout", type=float, default=None, help="seconds a run may take")
    ru.add_argument("--json", default=None, help="the record: every run, its tree, commit and figures")
    ru.add_argument("command", nargs=argparse.REMAINDER, help="after --: the benchmark, with {json}")
    args = p.parse_args(argv)
    if args.action == "export":
        for rev in args.revs:
            export(rev, args.into)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("run: the command goes after --")
    missing = [str(t) for t in args.trees if not t.is_dir()]
    if missing:
        p.error(f"no such tree: {', '.join(missing)} (python -m bench.ab export REV writes .ab/REV)")
    runs = run(args.trees, command, args.rounds, args.keys, args.timeout)
    print(table(runs, args.trees))
    if args.json:
        write_json(args.json, {**metadata(), "ab_command": shlex.join(command), "rounds": args.rounds,
                               "trees": [{"tree": str(t), "commit": tree_commit(t)} for t in args.trees],
                               "runs": runs})


if __name__ == "__main__":
    main(sys.argv[1:])
