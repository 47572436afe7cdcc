"""The README's and docs/results.md's headline tables are what their JSON files render: a figure is
never typed by hand (bench.readme_tables)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import history, readme_tables

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def at_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("document", readme_tables.DOCUMENTS, ids=str)
def test_tables_are_what_their_files_render(document: Path) -> None:
    text = document.read_text()
    assert readme_tables.BLOCK.search(text), f"{document} has no rendered table"
    assert readme_tables.render(text, document) == text, f"run python -m bench.readme_tables: {document} differs"


@pytest.mark.parametrize("document", readme_tables.DOCUMENTS, ids=str)
def test_tables_link_files_that_exist_from_their_document(document: Path) -> None:
    for block in readme_tables.BLOCK.finditer(document.read_text()):
        for link in re.findall(r"\]\(([^)]+\.json)\)", block["body"]):
            assert (document.parent / link).is_file(), f"{document}: table {block['name']} links {link}, not there"


def test_every_table_is_in_a_document() -> None:
    names = {m["name"] for doc in readme_tables.DOCUMENTS for m in readme_tables.BLOCK.finditer(doc.read_text())}
    assert names == set(readme_tables.TABLES)
    in_readme = {m["name"] for m in readme_tables.BLOCK.finditer(Path("README.md").read_text())}
    assert {"scenario-2xh200", "scenario-h200", "load-h200", "load-2xh200", "engine-h200"} <= in_readme


def test_the_simulators_costs_and_plans_are_in_the_scaling_doc() -> None:
    names = {m["name"] for m in readme_tables.BLOCK.finditer(Path("docs/scaling.md").read_text())}
    assert names == {"planner-costs", "simulate-plan", "simulate-plan-network", "simulate-validation",
                     "replica-counts", "serving-costs", "prediction-compared"}


def test_the_recorded_costs_are_what_bench_results_fit() -> None:
    """docs/scaling.md's costs table renders simulate-costs.json: it must hold the fits of the files there now."""
    from planner.costs import RESULTS
    from planner.fits import costs_record, fit_costs

    recorded = json.loads(Path("bench/results/simulate-costs.json").read_text())
    now = json.loads(json.dumps(costs_record(fit_costs(RESULTS))))
    for old, new in zip(recorded["fits"], now["fits"], strict=True):
        assert (old["field"], old["points"]) == (new["field"], new["points"]), "run python -m planner --costs"
        assert old["params"] == pytest.approx(new["params"], rel=1e-6), f"{old['name']}: run python -m planner --costs"
    assert (recorded["kv_tail_ms"], recorded["kv_send_ms"]) == pytest.approx((now["kv_tail_ms"], now["kv_send_ms"]))


def test_a_changed_cost_changes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import planner_tables

    doc = json.loads(Path("bench/results/simulate-costs.json").read_text())
    before = planner_tables.planner_costs()
    fit = next(f for f in doc["fits"] if f["field"] == "later_turn")
    fit["params"] = [5.0, 0.01, 0.0001, 0.0]
    (tmp_path / "simulate-costs.json").write_text(json.dumps(doc))
    monkeypatch.setattr(history, "RESULTS", tmp_path)
    row = next(line for line in planner_tables.planner_costs().splitlines() if line.startswith("| later turn:"))
    assert row not in before and "5 + 0.01·c + 0.0001·P ms (terms that fitted negative dropped)" in row


def test_a_changed_figure_changes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(Path("bench/results/engine-h200.json").read_text())
    doc["decode_ms"]["1"] = 9.876
    (tmp_path / "engine-h200.json").write_text(json.dumps(doc))
    monkeypatch.setattr(history, "RESULTS", tmp_path)  # where every renderer's `load` reads
    assert "9.876 ms" in readme_tables.engine_h200()
    text = "<!-- table:engine-h200 -->\nstale\n<!-- /table -->\n"
    assert "stale" not in readme_tables.render(text) and "9.876 ms" in readme_tables.render(text)


def test_check_fails_on_a_typed_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    typed = tmp_path / "README.md"
    typed.write_text("<!-- table:engine-h200 -->\n| typed | 1 ms |\n<!-- /table -->\n")
    monkeypatch.setattr(readme_tables, "DOCUMENTS", (typed,))
    with pytest.raises(SystemExit, match="tables differ"):
        readme_tables.main(["--check"])
    assert "typed" in typed.read_text()  # --check writes nothing


def test_headline_keeps_the_runs_it_replaces() -> None:
    from bench.headline import with_history

    old: dict = {}
    for k in range(6):
        old = with_history({"commit": f"c{k}", "rows": [k], "previous": {"stale": True}}, old or None)
    chain = [run["commit"] for run in history.runs(old)]
    assert chain == [f"c{k}" for k in range(5, -1, -1)]  # newest first, none dropped


def test_headline_refuses_a_machine_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import headline

    monkeypatch.setattr(headline, "gpu_count", lambda: 0)
    with pytest.raises(SystemExit, match="no measurement runs on 0 GPU"):
        headline.main([])


def test_headline_stops_a_run_past_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement that overruns is stopped (its whole process group) and its file left as it was."""
    import time

    from bench import headline

    monkeypatch.setattr(headline, "RESULTS", tmp_path)
    # a run that never ends
    forever = headline.Measurement("forever", 0, ["http.server", "0", "--bind", "127.0.0.1"], 1)
    started = time.monotonic()
    assert headline.measure(forever, None, tmp_path) is False
    assert time.monotonic() - started < headline.STOP_S and not forever.file.exists()


def test_make_results_measures_every_readme_table() -> None:
    """`make results` (bench.headline) re-measures each table the README shows, and its one-GPU runs' budgets
    fit the one 10-minute call its docstring promises on one H200."""
    from bench import headline

    in_readme = {m["name"] for m in readme_tables.BLOCK.finditer(Path("README.md").read_text())}
    assert in_readme <= {m.name for m in headline.MEASUREMENTS}
    assert sum(m.budget_s for m in headline.MEASUREMENTS if m.gpus == 1) <= 600


def test_the_validation_table_counts_what_its_file_scored() -> None:
    """Each group's rows within the target add up to the file's own count, and every miss is listed."""
    from bench.planner_tables import validation

    doc = json.loads(Path("bench/results/simulate-validation.json").read_text())
    rows = [line.split(" | ") for line in validation().splitlines() if line.startswith("| `")]
    within = [int(cells[1].split(" of ")[0]) for cells in rows]
    total = [int(cells[1].split(" of ")[1]) for cells in rows]
    assert (sum(within), sum(total)) == (doc["within_target"], doc["scored_rows"])
    misses = sum(0 if cells[2].rstrip(" |") == "–" else len(cells[2].split("; ")) for cells in rows)
    assert misses == doc["scored_rows"] - doc["within_target"]
