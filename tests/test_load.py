"""The load generator: a reproducible plan, vLLM-style statistics, and short real runs against the CPU pair."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from client.load import parse_compare
from client.load_plan import Length, LoadPlan, LoadSpec, build_plan
from client.load_run import Deployment, Record, RunResult
from client.load_stats import Slo, summarize
from tests.servers import ROOT, ServerProcess, free_port, free_port_run

SPEC = LoadSpec(rate=8, duration=2, prompt_len="uniform:16:64", output_len="8", background_users=2,
                long_prompt_frac=0.25, long_prompt_len=300, seed=1)
DISTRIBUTIONS = ("ttft_ms", "tpot_ms", "itl_ms")


def plan_signature(plan: LoadPlan, per_user: int = 5) -> list[Any]:
    background = [user.next().signature() for user in plan.users for _ in range(per_user)]
    return [a.signature() for a in plan.arrivals] + background


def run_load(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.load", "--no-progress", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def check_distribution(stats: dict[str, float]) -> None:
    assert set(stats) >= {"mean", "p50", "p90", "p99"}
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]


# --- the plan -------------------------------------------------------------------------------------
def test_same_seed_same_plan_other_seed_other_plan() -> None:
    first, second = build_plan(SPEC), build_plan(SPEC)
    assert len(first.arrivals) > 5 and plan_signature(first) == plan_signature(second)
    other = build_plan(LoadSpec(**{**vars(SPEC), "seed": 2}))
    assert plan_signature(other) != plan_signature(build_plan(SPEC))
    for spec in build_plan(SPEC).arrivals:
        assert 0 <= spec.at < SPEC.duration and spec.output_len == 8
        assert (len(spec.token_ids) == 300) if spec.long else (16 <= len(spec.token_ids) <= 64)
        assert spec.token_ids.min() >= 0 and spec.token_ids.max() < 256
    assert any(a.long for a in first.arrivals) and not all(a.long for a in first.arrivals)


def test_conversations_keep_the_arrivals_and_resend_their_history() -> None:
    multi = LoadSpec(**{**vars(SPEC), "turns": 3, "turn_prompt_len": "uniform:5:9"})
    plan, single = build_plan(multi), build_plan(SPEC)
    assert [a.signature() for a in plan.arrivals] == [a.signature() for a in single.arrivals]
    assert plan_signature(build_plan(multi)) == plan_signature(plan)  # later turns are seeded too
    assert all(a.later_turns == () for a in single.arrivals)
    first = plan.arrivals[0]
    assert len(first.later_turns) == 2 and all(5 <= len(t.message) <= 9 for t in first.later_turns)
    second = first.follow_up([300, 301], at=1.5)
    assert second is not None and (second.key, second.kind, second.turn, second.at) == ("r0.t2", "turn", 2, 1.5)
    assert second.token_ids.tolist() == [*first.token_ids.tolist(), 300, 301, *first.later_turns[0].message.tolist()]
    assert second.output_len == first.later_turns[0].output_len
    third = second.follow_up([7], at=2.0)
    assert third is not None and third.key == "r0.t3" and third.token_ids[:len(second.token_ids)].tolist() == \
        second.token_ids.tolist()
    assert third.follow_up([8], at=3.0) is None
    messages = [t.message.tolist() for a in plan.arrivals for t in a.later_turns]
    assert len({tuple(m) for m in messages}) > len(messages) // 2  # each message drawn afresh
    with pytest.raises(ValueError, match="--turns"):
        LoadSpec(turns=0)


def test_an_id_salt_keeps_lengths_and_times_but_shares_no_prefix() -> None:
    """Runs that share a prefix cache (deployments in turn, a sweep's rates) each get their own salt:
    the same arrivals, lengths, turns and background users, with token ids relabelled."""
    base = LoadSpec(**{**vars(SPEC), "turns": 2, "background_users": 2})
    salted = LoadSpec(**{**vars(base), "id_salt": 101})
    plain, other = build_plan(base), build_plan(salted)
    assert plan_signature(build_plan(salted)) == plan_signature(other)  # still seeded
    for a, b in zip(plain.arrivals, other.arrivals, strict=True):
        assert (a.key, a.at, a.output_len, a.long, len(a.token_ids)) == (b.key, b.at, b.output_len, b.long,
                                                                          len(b.token_ids))
        assert [len(t.message) for t in a.later_turns] == [len(t.message) for t in b.later_turns]
        assert a.token_ids[:16].tolist() != b.token_ids[:16].tolist()  # no shared first block
        assert b.token_ids.min() >= 0 and b.token_ids.max() < 256
    for u, v in zip(build_plan(base).users, build_plan(salted).users, strict=True):
        x, y = u.next(), v.next()
        assert len(x.token_ids) == len(y.token_ids) and x.token_ids.tolist() != y.token_ids.tolist()
    # a permutation: the same multiset of ids relabelled, so equal ids stay equal
    first_plain, first_salted = plain.arrivals[0].token_ids, other.arrivals[0].token_ids
    mapping = dict(zip(first_plain.tolist(), first_salted.tolist(), strict=True))
    assert all(mapping[p] == s for p, s in zip(first_plain.tolist(), first_salted.tolist(), strict=True))


def test_length_distributions() -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    assert Length.parse("1024").sample(rng) == 1024
    assert {Length.parse("uniform:3:5").sample(rng) for _ in range(200)} == {3, 4, 5}
    draws = [Length.parse("lognormal:1000:0.5").sample(rng) for _ in range(4000)]
    assert 900 < sum(draws) / len(draws) < 1100  # MEAN is the lengths' mean
    for bad in ("0", "uniform:5:3", "normal:3:4", "lognormal:10", "x"):
        with pytest.raises(ValueError):
            Length.parse(bad)


def test_compare_syntax() -> None:
    d = parse_compare("split=a:1,b:2@chunked:256", (), None, 0)
    assert d == Deployment("split", ("a:1", "b:2"), "chunked", 256)
    assert parse_compare("x=@colocated", ("t:1",), None, 0) == Deployment("x", ("t:1",), "colocated", 0)
    assert parse_compare("y=t:1", (), "chunked", 64) == Deployment("y", ("t:1",), "chunked", 64)
    p = parse_compare("p=t:1@partitioned:104", (), None, 512)  # the size is partitioned's SM count
    assert p == Deployment("p", ("t:1",), "partitioned", 512, prefill_sms=104)
    assert "partitioned:104" in p.describe()
    for bad in ("nameonly", "z=@colocated", "w=t:1@fast"):
        with pytest.raises(ValueError):
            parse_compare(bad, (), None, 0)


def test_summary_follows_vllm_definitions() -> None:
    fast = Record("r0", "arrival", "t", 10, 3, False, 0.0, [0.1, 0.12, 0.14])      # TTFT 100 ms, TPOT 20 ms
    slow = Record("r1", "arrival", "t", 20, 3, False, 0.0, [0.5, 0.6, 0.7])        # TTFT 500 ms, TPOT 100 ms
    failed = Record("r2", "arrival", "t", 30, 3, False, 0.0, status="UNAVAILABLE", error_message="down")
    result = RunResult(Deployment("d", ("t",)), [fast, slow, failed], duration_s=2.0)
    s = summarize(result, Slo(ttft_ms=200, itl_ms=50))
    assert (s["completed"], s["failed"], s["failures"]) == (2, 1, {"UNAVAILABLE": 1})
    assert s["goodput_rps"] == 0.5 and s["request_throughput"] == 1.0 and s["output_tok_per_s"] == 3.0
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["tpot_ms"]["mean"] == pytest.approx(60)
    assert s["itl_ms"]["max"] == pytest.approx(100) and s["itl_ms"]["p50"] == pytest.approx(60)
    assert summarize(result, Slo())["goodput_rps"] == 1.0  # no SLO: every completed request counts


def test_per_token_goodput_sees_a_stall_the_mean_hides() -> None:
    # 100 gaps of 10 ms and one of 500 ms: TPOT ~14.9 ms meets a 50 ms mean, its P99 gap does not
    times = [0.1 + 0.01 * i for i in range(100)]
    stalled = Record("r0", "arrival", "t", 10, 101, False, 0.0, [*times, times[-1] + 0.5])
    smooth = Record("r1", "arrival", "t", 10, 101, False, 0.0, [0.1 + 0.01 * i for i in range(101)])
    result = RunResult(Deployment("d", ("t",)), [stalled, smooth], duration_s=1.0)
    assert summarize(result, Slo(ttft_ms=200, itl_ms=50, itl_p99_ms=50))["goodput_itl_p99_rps"] == 2.0  # P99 misses it
    s = summarize(result, Slo(ttft_ms=200, itl_ms=50, itl_max_ms=50))
    assert s["goodput_rps"] == 2.0 and s["goodput_itl_p99_rps"] == 1.0
    stalls = Record("r2", "arrival", "t", 10, 100, False, 0.0, [t + 0.5 * (i // 20) for i, t in enumerate(times)])
    stalled_often = RunResult(Deployment("d", ("t",)), [stalls], duration_s=1.0)
    assert summarize(stalled_often, Slo(itl_p99_ms=50))["goodput_itl_p99_rps"] == 0.0  # 4 stalls in 99 gaps
    assert summarize(result, Slo(ttft_ms=200, itl_ms=50))["goodput_itl_p99_rps"] == 2.0  # no per-token limit
    assert summarize(result, Slo(ttft_ms=50, itl_p99_ms=1000))["goodput_itl_p99_rps"] == 0.0  # TTFT still counts


# --- real runs ------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_load_run_against_pair(pair: tuple[ServerProcess, ServerProcess], tmp_path: Path) -> None:
    decode, _ = pair
    out = tmp_path / "load.json"
    done = run_load("--target", decode.address, "--rate", "8", "--duration", "2", "--prompt-len", "uniform:16:64",
                    "--output-len", "8", "--background-users", "1", "--seed", "1", "--slo-ttft-ms", "10000",
                    "--slo-itl-ms", "10000", "--json", str(out), "--json-details")
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "P99 ITL (ms)" in done.stdout
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["failures"] == {}, report["failure_examples"]
    assert report["completed"] > 0 and report["duration_s"] >= 2.0
    assert report["output_tok_per_s"] > 0 and 0 < report["goodput_rps"] <= report["request_throughput"]
    for key in DISTRIBUTIONS:
        check_distribution(report[key])
    assert report["params"]["rate"] == 8 and report["params"]["seed"] == 1
    assert datetime.fromisoformat(report["date"]).tzinfo is not None and "--rate 8" in report["command"]
    requests = report["requests"]
    assert len(requests) == report["completed"] and all(r["output_tokens"] == 8 for r in requests)
    # what went over the wire is the plan: the arrivals' prompt lengths, in order
    planned = build_plan(LoadSpec(rate=8, duration=2, prompt_len="uniform:16:64", output_len="8",
                                  background_users=1, seed=1))
    sent = {r["key"]: r["prompt_len"] for r in requests if r["kind"] == "arrival"}
    assert sent == {a.key: len(a.token_ids) for a in planned.arrivals}


@pytest.mark.e2e
def test_multi_turn_run_against_pair(pair: tuple[ServerProcess, ServerProcess], tmp_path: Path) -> None:
    decode, _ = pair
    out = tmp_path / "turns.json"
    done = run_load("--target", decode.address, "--rate", "3", "--duration", "1", "--prompt-len", "40",
                    "--output-len", "5", "--turns", "3", "--turn-prompt-len", "12", "--seed", "3", "--json", str(out),
                    "--json-details")
    assert done.returncode == 0, done.stderr
    assert "later turns TTFT" in done.stdout
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["params"]["turns"] == 3
    requests = {r["key"]: r for r in report["requests"]}
    arrivals = [k for k, r in requests.items() if r["kind"] == "arrival"]
    assert arrivals and report["completed"] == 3 * len(arrivals)
    for key in arrivals:  # each turn: the previous prompt, its 5-token answer and a 12-token message
        turns = [requests[key], requests[f"{key}.t2"], requests[f"{key}.t3"]]
        assert [r["turn"] for r in turns] == [1, 2, 3] and [r["prompt_len"] for r in turns] == [40, 57, 74]
        assert turns[0]["token_times_s"][-1] <= turns[1]["sent_s"] and turns[1]["token_times_s"][-1] <= \
            turns[2]["sent_s"]
    for key in ("first_turn_ttft_ms", "later_turn_ttft_ms"):
        check_distribution(report[key])


@pytest.mark.e2e
def test_compare_two_modes_on_one_server(pair: tuple[ServerProcess, ServerProcess], tmp_path: Path) -> None:
    decode, _ = pair
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    done = run_load("--target", decode.address, "--rate", "6", "--duration", "1", "--prompt-len", "32",
                    "--output-len", "6", "--background-users", "1", "--slo-ttft-ms", "0.001", "--json", str(out),
                    "--plot", str(png), "--compare", "split=@disaggregated",
                    f"local={decode.address}@colocated")
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["split", "local"] and "split" in done.stdout and "local" in done.stdout
    assert [runs[n]["mode"] for n in runs] == ["disaggregated", "colocated"]
    for run in runs.values():
        assert run["completed"] > 0 and run["failed"] == 0, run["failure_examples"]
        assert run["goodput_rps"] == 0  # nothing meets a 1 us TTFT
        for key in DISTRIBUTIONS:
            check_distribution(run[key])
    assert png.stat().st_size > 10_000


def test_failures_are_counted_by_status_not_raised(pair: tuple[ServerProcess, ServerProcess],
                                                   tmp_path: Path) -> None:
    decode, _ = pair
    out = tmp_path / "fail.json"
    # 45,000 tokens pass the tiny model's context limit: the server answers INVALID_ARGUMENT
    done = run_load("--rate", "20", "--duration", "0.5", "--prompt-len", "45000", "--output-len", "4", "--no-warmup",
                    "--json", str(out), "--compare", f"dead=127.0.0.1:{free_port()}", f"too-long={decode.address}")
    assert done.returncode == 1, done.stderr  # nothing completed anywhere
    runs = json.loads(out.read_text())["runs"]
    planned = json.loads(out.read_text())["params"]["planned_arrivals"]
    assert planned > 0
    assert runs["dead"]["failures"] == {"UNAVAILABLE": planned} and runs["dead"]["completed"] == 0
    assert runs["too-long"]["failures"] == {"INVALID_ARGUMENT": planned}
    assert runs["too-long"]["ttft_ms"]["p50"] is None


@pytest.mark.e2e
def test_bench_load_two_device_layout(tmp_path: Path) -> None:
    """`bench.e2e.deployments --devices A B` starts the split pair and one decode server per device, and sends the
    same load to each deployment (on the CPU here: the layout and the wiring, not the speed)."""
    out = tmp_path / "load.json"
    load_args = ("--rate 4 --duration 1.5 --prompt-len uniform:16:64 --output-len 6 --background-users 1 "
                 "--long-prompt-frac 0.25 --long-prompt-len 300 --seed 3")
    done = subprocess.run([sys.executable, "-m", "bench.e2e.deployments", "--preset", "tiny", "--devices", "cpu", "cpu",
                           "--kv-cache-gb", "0.1", "--port", str(free_port_run(4)), "--load-args", load_args,
                           "--server-args", "--gil-switch-ms 1", "--json", str(out), "--logs", str(tmp_path / "logs"),
                           "--plot", str(tmp_path / "load.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert list(runs) == ["split", "auto", "colocated", "chunked-512", "chunked-2048", "layered", "partitioned"]
    assert [runs[n]["mode"] for n in runs] == ["disaggregated", "auto", "colocated", "chunked", "chunked", "layered",
                                               "partitioned"]
    assert runs["split"]["targets"] == runs["auto"]["targets"] and len(runs["split"]["targets"]) == 1
    assert all(len(runs[n]["targets"]) == 2 for n in list(runs)[2:])
    assert set(runs["auto"]["placement"]) <= {"local", "remote"} and sum(runs["auto"]["placement"].values()) > 0
    assert doc["params"]["distinct_ids"] is True  # the servers keep their caches: no deployment sees another's
    for run in runs.values():
        assert run["completed"] > 0 and run["failed"] == 0, run["failure_examples"]
    assert doc["devices"] == ["cpu", "cpu"] and len(doc["servers"]) == 4 and doc["commit"]
    assert (tmp_path / "load.png").read_bytes().startswith(b"\x89PNG")
    assert all("--gil-switch-ms 1" in server for server in doc["servers"])
    # where TTFT went, per deployment: only the split pair hands KV over, only its prompts queue remotely
    split, colocated = runs["split"]["server_mean_ms"], runs["colocated"]["server_mean_ms"]
    assert split["prefill_s"] > 0 and split["kv_transfer_s"] > 0 and split["prefill_queue_s"] >= 0
    assert colocated["prefill_s"] > 0 and colocated["kv_transfer_s"] == 0 == colocated["prefill_queue_s"]
    assert "Decode server's timing, mean" in done.stdout and "KV handoff beyond the prefill (ms)" in done.stdout


@pytest.mark.e2e
def test_bench_load_cache_compare_merges_into_the_results(tmp_path: Path) -> None:
    """`bench.e2e.deployments --cache-compare --merge`: a multi-turn load against a decode server with its prefix
    cache and one without, added to an existing results file whose runs stay as they were."""
    out = tmp_path / "load.json"
    out.write_text(json.dumps({"runs": {"colocated": {"completed": 7}}, "date": "then", "commit": "old"}))
    load_args = "--rate 4 --duration 1 --prompt-len 120 --turn-prompt-len 20 --turns 3 --output-len 6 --seed 3"
    done = subprocess.run([sys.executable, "-m", "bench.e2e.deployments", "--preset", "tiny", "--devices", "cpu",
                           "--cache-compare", "--merge", "--kv-cache-gb", "0.05", "--port", str(free_port_run(2)),
                           "--load-args", load_args, "--json", str(out), "--logs", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert runs["colocated"] == {"completed": 7} and (doc["date"], doc["commit"]) == ("then", "old")
    cached, plain = runs["prefix-cache"], runs["no-prefix-cache"]
    for run in (cached, plain):
        assert run["failed"] == 0 and run["params"]["turns"] == 3 and "--cache-compare" in run["recorded"]["command"]
        check_distribution(run["later_turn_ttft_ms"])
    assert cached["cached_prompt_frac"] > 0.3 and plain["cached_prompt_frac"] == 0
    assert "--no-prefix-cache" in " ".join(plain["recorded"]["servers"])


@pytest.mark.e2e
def test_bench_load_one_device_with_its_prefix_cache(tmp_path: Path) -> None:
    """`bench.e2e.deployments --prefix-cache` on one device: the server keeps its cache, each deployment's ids are its
    own, so every deployment's later turns find their conversation cached and none finds another's."""
    out = tmp_path / "load.json"
    load_args = "--rate 4 --duration 1 --prompt-len 120 --turn-prompt-len 20 --turns 3 --output-len 6 --seed 3"
    done = subprocess.run([sys.executable, "-m", "bench.e2e.deployments", "--preset", "tiny", "--devices", "cpu",
                           "--prefix-cache", "--only", "colocated", "layered", "--kv-cache-gb", "0.05",
                           "--port", str(free_port_run(1)), "--load-args", load_args, "--json", str(out),
                           "--logs", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["params"]["distinct_ids"] is True and "--no-prefix-cache" not in " ".join(doc["servers"])
    assert list(doc["runs"]) == ["colocated", "layered"]
    for run in doc["runs"].values():
        assert run["failed"] == 0 and 0.3 < run["cached_prompt_frac"] < 0.9  # later turns only: no deployment's
        check_distribution(run["later_turn_ttft_ms"])                        # first turn found another's
    refused = subprocess.run([sys.executable, "-m", "bench.e2e.deployments", "--devices", "cpu", "--prefix-cache",
                              "--cache-compare"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--prefix-cache is for the one server" in refused.stderr


@pytest.mark.e2e
def test_bench_load_rate_sweep_with_the_prediction_beside(tmp_path: Path) -> None:
    """`bench.e2e.deployments --rates`: the servers start once, the load runs per rate (each with its own id salt), and
    the JSON holds each deployment's points by rate beside the recorded prediction, plotted."""
    out, prediction = tmp_path / "sweep.json", tmp_path / "prediction.json"
    predicted = [{"rate": r, "goodput_rps": g, "ttft_ms": {"p50": 1.0}, "itl_ms": {"p99": 2.0}}
                 for r, g in ((3.0, 2.0), (6.0, 4.0))]
    prediction.write_text(json.dumps({"date": "then", "commit": "abc", "runs": {"colocated": {"sweep": predicted}}}))
    load_args = "--duration 0.6 --prompt-len uniform:16:48 --output-len 4 --slo-ttft-ms 60000 --slo-itl-ms 6e4 --seed 5"
    port = free_port_run(1)
    done = subprocess.run([sys.executable, "-m", "bench.e2e.deployments", "--preset", "tiny", "--devices", "cpu",
                           "--kv-cache-gb", "0.05", "--port", str(port), "--load-args", load_args, "--rates", "3", "6",
                           "--compare", f"colocated=127.0.0.1:{port}@colocated", f"layered=127.0.0.1:{port}@layered",
                           "--prediction", str(prediction), "--json", str(out), "--plot", str(tmp_path / "sweep.png"),
                           "--logs", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["params"]["rates"] == [3.0, 6.0] and set(doc["runs_by_rate"]) == {"3.0", "6.0"}
    assert list(doc["sweep"]) == ["colocated", "layered"]
    for points in doc["sweep"].values():
        assert [p["rate"] for p in points] == [3.0, 6.0]
        assert all(p["completed"] > 0 and p["failed"] == 0 and p["goodput_rps"] > 0 for p in points)
    assert doc["prediction"]["commit"] == "abc" and list(doc["prediction"]["runs"]) == ["colocated"]
    rows = doc["prediction_compared"]
    assert [(r["deployment"], r["rate"]) for r in rows] == [("colocated", 3.0), ("colocated", 6.0)]
    first = rows[0]
    assert first["rel_error"] == round((2.0 - first["measured_goodput_rps"]) / first["measured_goodput_rps"], 4)
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
    assert doc["load_command"].count("--rate 6.0") == 1 and "--id-salt 200" in doc["load_command"]
