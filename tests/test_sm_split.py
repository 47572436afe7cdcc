"""Partitioned mode's split of the SMs: the device's split rules, the table --itl-slo-ms picks
from, the flags, and the green-context adapter across PyTorch's two APIs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from decode_server.__main__ import parse_config
from decode_server.config import DecodeConfig
from decode_server.sm_split import DEFAULT_TABLE, SplitTable, open_partitions
from engine import green_context
from engine.green_context import split_problem


def test_hopper_splits_in_eights_and_keeps_some_sms_for_decode() -> None:
    h200 = (132, (9, 0))
    assert split_problem(64, *h200) is None and split_problem(104, *h200) is None
    assert "multiples of 8" in (split_problem(100, *h200) or "") and "use 104" in (split_problem(100, *h200) or "")
    assert "use 8" in (split_problem(4, *h200) or "")
    assert "at most 124" in (split_problem(128, *h200) or "")
    assert split_problem(6, 108, (8, 0)) is None and "at least 4" in (split_problem(2, 108, (8, 0)) or "")


def write_table(folder: Path, rows: list[tuple[int, float]], alone: float = 4.0) -> Path:
    path = folder / "table.json"
    path.write_text(json.dumps({"provenance": {"source": "test"}, "decode_step_alone_ms": alone,
                                "rows": [{"prefill_sms": n, "a_gap_ms": gap} for n, gap in rows]}))
    return path


def test_the_slo_picks_the_most_sms_whose_gap_fits(tmp_path: Path) -> None:
    table = SplitTable.load(write_table(tmp_path, [(104, 10.7), (72, 5.9), (88, 7.5)]))
    assert table.pick(8.0) == (88, 8.0)
    assert table.pick(11.0)[0] == 104
    assert table.pick(None) == (88, 8.0)  # twice the decode step alone
    with pytest.raises(ValueError, match="no split .* within 5 ms .* 72 prefill SMs"):
        table.pick(5.0)


def test_the_shipped_table_says_where_its_rows_come_from() -> None:
    doc = json.loads(DEFAULT_TABLE.read_text())
    assert doc["provenance"]["source"] and doc["provenance"]["hardware"]
    table = SplitTable.load()
    assert all(split_problem(r.prefill_sms, 132, (9, 0)) is None for r in table.rows)  # valid on an H200
    assert table.pick(None)[0] in {r.prefill_sms for r in table.rows}


def test_a_bad_table_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"rows": [{"sms": 3}]}')
    with pytest.raises(ValueError, match="can't read it"):
        SplitTable.load(tmp_path / "bad.json")


def test_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _ = parse_config(["--mode", "partitioned", "--prefill-sms", "96"])
    assert cfg.prefill_sms == 96 and cfg.default_mode == "partitioned"
    assert parse_config(["--itl-slo-ms", "8"])[0].itl_slo_ms == 8.0
    for bad in (["--prefill-sms", "64", "--itl-slo-ms", "8"], ["--prefill-sms", "0"], ["--itl-slo-ms", "-1"]):
        with pytest.raises(SystemExit):
            parse_config(bad)
        assert "--prefill-sms" in capsys.readouterr().err


def test_without_a_gpu_partitioned_falls_back_to_layered_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        assert open_partitions(DecodeConfig(mode="partitioned"), torch.device("cpu")) == (None, 0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "falls back to layered" in line and "CUDA device" in line


class _Context:
    def __init__(self, num_sms: int, device_id: int) -> None:
        self.num_sms, self.device_id = num_sms, device_id


class OldApi:  # torch 2.10/2.11: create(num_sms, device_id=0), set_context/pop_context
    @staticmethod
    def create(num_sms: int, device_id: int = 0) -> _Context:
        return _Context(num_sms, device_id)


class NewApi:  # a constructor with keyword arguments, no create
    def __init__(self, *, num_sms: int, device_id: int) -> None:
        self.num_sms, self.device_id = num_sms, device_id


@pytest.mark.parametrize("api", [OldApi, NewApi])
def test_the_adapter_creates_a_context_with_either_api(monkeypatch: pytest.MonkeyPatch, api: Any) -> None:
    from torch.cuda import green_contexts

    monkeypatch.setattr(green_contexts, "GreenContext", api)
    context = green_context._create(96, 1)
    assert (context.num_sms, context.device_id) == (96, 1)


@pytest.mark.e2e
def test_scenario_rows_at_several_splits_make_the_plot_and_the_table(scenario_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The documented GPU commands, end to end on the CPU (where partitioned runs as layered): scenario rows
    at two SM counts, then the trade-off plot and the SLO table the decode server reads."""
    import subprocess
    import sys

    from tests.servers import ROOT

    decode, _ = scenario_pair
    scenario, table, png = tmp_path / "scenario.json", tmp_path / "table.json", tmp_path / "tradeoff.png"
    proc = subprocess.run([sys.executable, "-m", "client.scenario", "--target", decode.address, "--b-len", "512",
                           "--a-len", "128", "--a-new-tokens", "30", "--modes",
                           "alone,colocated,layered,partitioned:16,partitioned:32", "--json", str(scenario)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "partitioned, 16 SMs" in proc.stdout
    rows = json.loads(scenario.read_text())["rows"]
    assert [r["prefill_sms"] for r in rows] == [None, None, None, 16, 32]
    assert all(r["b_tokens_match_reference"] for r in rows[1:])
    proc = subprocess.run([sys.executable, "-m", "bench.e2e.partitioned_splits", str(scenario), "--b-len", "512",
                           "--table", str(table), "--plot", str(png)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = SplitTable.load(table)
    assert [r.prefill_sms for r in loaded.rows] == [16, 32]
    assert [r.a_gap_ms for r in loaded.rows] == [round(r["a_worst_gap_ms"], 2) for r in rows[3:]]
    assert loaded.decode_step_alone_ms == round(rows[0]["a_median_gap_ms"], 3)
    assert json.loads(table.read_text())["provenance"]["date"]
    assert png.read_bytes().startswith(b"\x89PNG")
