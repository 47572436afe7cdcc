"""Tables that compare one tree with another, rendered into the documents by `python -m bench.readme_tables`:
`python -m bench.ab`'s comparisons (on one card in one call), and a result file against the run it keeps
as `previous`."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from bench.ab import pick
from bench.history import Doc, load
from bench.markdown import ms, table


def by_tree(doc: Doc) -> list[list[Doc]]:
    """Each tree's outputs, one a round, in the order the trees were given."""
    return [[r["output"] for r in doc["runs"] if r["commit"] == tree["commit"]] for tree in doc["trees"]]


def median_of_rounds(outputs: list[Doc], figure: Callable[[Doc], float | None]) -> float | None:
    values = [v for v in map(figure, outputs) if v is not None]
    return statistics.median(values) if values else None


def about(doc: Doc, file: str) -> str:
    trees = " against ".join(t["commit"] for t in doc["trees"])
    return (f"[`{file}`](bench/results/{file}): {doc['hardware']}, {doc['date'][:10]}, {trees}, "
            f"{doc['rounds']} round{'s' * (doc['rounds'] > 1)}, `{doc['command']}`")


def later_turn(prefix: int, new: int) -> Callable[[Doc], float | None]:
    def figure(output: Doc) -> float | None:
        return next((r["ms"] for r in output["later_turns"]
                     if (r["prefix"], r["new"], r["batch"]) == (prefix, new, 0)), None)
    return figure


def scenario_row(mode: str, chunk: int | None, key: str) -> Callable[[Doc], float | None]:
    def figure(output: Doc) -> float | None:
        return next((r[key] for r in output["rows"] if (r["mode"], r["chunk_size"]) == (mode, chunk)), None)
    return figure


def by_commit(files: tuple[str, ...], figure: Callable[[Doc], float | None]) -> dict[str, float]:
    """The median of each commit's rounds, over the files in turn (the first file with a commit gives its figure)."""
    found: dict[str, float] = {}
    for file in files:
        doc = load(file)
        for tree, outputs in zip(doc["trees"], by_tree(doc), strict=True):
            value = median_of_rounds(outputs, figure)
            if value is not None:
                found.setdefault(tree["commit"], value)
    return found


Row = tuple[str, tuple[str, ...], Callable[[Doc], float | None]]  # label, the files it is read from, the figure


def ab_table(rows: list[Row], labels: dict[str, str]) -> str:
    """One row a figure, one column a commit (in the order the files name them); every file's provenance above."""
    files = list(dict.fromkeys(f for _, fs, _ in rows for f in fs))
    commits = list(dict.fromkeys(t["commit"] for f in files for t in load(f)["trees"]))
    header = ["", *(f"{c} ({labels.get(c, '')})" for c in commits)]
    cells = []
    for label, fs, figure in rows:
        found = by_commit(fs, figure)
        cells.append([label, *(ms(found.get(c)) for c in commits)])
    sources = "; ".join(about(load(f), f) for f in files)
    return f"*{sources}.*\n\n" + table(header, cells)


def prefill_graphs_h100() -> str:
    """Eager prefills, the prefill graphs, then chunks attending on KV's own heads, each step's A/B on one
    H100 (the median of its rounds)."""
    turns: tuple[str, ...] = ("later-turns-prefill-graphs-ab-h100.json", "later-turns-grouped-heads-ab-h100.json")
    short: tuple[str, ...] = ("prefill-short-prefill-graphs-ab-h100.json",)
    scenario: tuple[str, ...] = ("scenario-chunked-prefill-graphs-ab-h100.json",)
    rows: list[Row] = [(f"{new} tokens after {prefix:,} cached", turns, later_turn(prefix, new))
            for prefix in (1024, 16384) for new in (64, 512)]
    rows += [(f"a whole {n:,}-token prompt", short, whole_prompt(n)) for n in (64, 512, 4096)]
    rows += [(f"32k scenario, 512-token chunks: {label}", scenario, scenario_row("chunked", 512, key))
             for key, label in (("a_median_gap_ms", "A's median gap"), ("a_worst_gap_ms", "A's worst gap"),
                                ("b_ttft_ms", "B's TTFT"))]
    return ab_table(rows, {"85c54d1": "eager", "0d66e0f": "graphed", "24d8c1a": "graphed, chunks on KV's own heads"})


def prefill_server_graphs_h100() -> str:
    """The prefill server's prefills eager, then as its runner's prefill graphs: a 256-token prompt handed to
    the decode server over CUDA IPC (the median of each run's repeats)."""
    files: tuple[str, ...] = ("kv-transfer-prefill-graphs-ab-h100.json",)
    rows: list[Row] = [(label, files, handoff_median(key, scale)) for key, scale, label in (
        ("prefill_ms", 1.0, "the prefill server's prefill"), ("seconds", 1e3, "the handoff beyond the prefill"),
        ("exposed_ms", 1.0, "the handoff exposed after the last layer"))]
    return ab_table(rows, {"79363d8": "eager", "4d8c35f": "graphed"})


def handoff_median(key: str, scale: float) -> Callable[[Doc], float | None]:
    def figure(output: Doc) -> float | None:
        values = [r[key] * scale for r in output["rows"] if r.get(key) is not None]
        return statistics.median(values) if values else None
    return figure


def whole_prompt(tokens: int) -> Callable[[Doc], float | None]:
    def figure(output: Doc) -> float | None:
        value = output["prefill_ms"].get(str(tokens))
        return None if value is None else float(value)
    return figure


def later_turns_h200(file: str = "engine-later-turns-h200.json") -> str:
    """A chat's later turn alone on one H200 (`bench.micro.engine_steps --later-turns`), the file's run beside
    the one before it."""
    doc = load(file)
    runs = [doc["previous"], doc] if "previous" in doc else [doc]  # the run before first
    turns = [{(r["prefix"], r["new"]): r["ms"] for r in run["later_turns"] if r["batch"] == 0} for run in runs]
    header = ["", *(f"{run['commit']} ({run['date'][:10]})" for run in runs)]
    cells = [[f"{new} tokens after {prefix:,} cached", *(ms(t.get((prefix, new))) for t in turns)]
             for prefix, new in sorted(turns[-1])]
    sources = "; ".join(f"{run['hardware']}, commit {run['commit']}, `{run['command']}`" for run in runs)
    return f"*[`{file}`](bench/results/{file}): {sources}.*\n\n" + table(header, cells)


def partition_graphs_h200() -> str:
    """Partitioned mode's later turns on 72 SMs of one H200, eager, then replaying the prefill thread's own
    graphs (`bench.micro.engine_steps --later-turns --later-turn-sms 72`)."""
    files: tuple[str, ...] = ("later-turns-partition-graphs-ab-h200.json",)
    rows: list[Row] = [(f"{new} tokens after {prefix:,} cached", files, later_turn(prefix, new))
                       for prefix in (1024, 16384) for new in (64, 400)]
    return ab_table(rows, {"b34fc91": "eager", "bea4f89": "graphed"})


def chat_figure(*path: str) -> Callable[[Doc], float | None]:
    """A figure of `bench.e2e.deployments`' partitioned run, by its path under the run."""
    def figure(output: Doc) -> float | None:
        value = pick(output, ".".join(("runs", "partitioned", *path)))
        return float(value) if isinstance(value, int | float) else None
    return figure


def partition_short_first_h100() -> str:
    """Partitioned chat on one H100 with its prefix cache: first come, first served against short prompts first
    (`--partitioned-short-first`'s code, there always on), two calls of one round each."""
    files = ("chat-partitioned-yield-ab-h100.json", "chat-partitioned-yield-ab-2-h100.json")
    labels = {"e78861c": "first come, first served", "b6a22c2": "short first: 3bc0c97's tree"}
    docs = [load(f) for f in files]
    columns = [(tree["commit"], k, outputs[0]) for k, doc in enumerate(docs, 1)
               for tree, outputs in zip(doc["trees"], by_tree(doc), strict=True)]
    columns.sort(key=lambda c: list(labels).index(c[0]))
    header = ["", *(f"{commit} ({labels[commit]}), call {k}" for commit, k, _ in columns)]
    rows = [[f"{label}, {stat}", *(ms(chat_figure(key, stat)(out)) for _, _, out in columns)]
            for key, label in (("later_turn_ttft_ms", "later turns' TTFT"), ("first_turn_ttft_ms", "first turns' TTFT"),
                               ("ttft_ms", "every TTFT"), ("itl_ms", "gap between tokens"))
            for stat in ("mean", "p90", "p99")]
    sources = "; ".join(about(doc, f) for doc, f in zip(docs, files, strict=True))
    return f"*{sources}.*\n\n" + table(header, rows)
