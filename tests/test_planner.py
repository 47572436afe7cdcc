"""The cluster simulator on the CPU: its fits, its bookkeeping, and that it answers like a serving system would."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from client.load_plan import LoadSpec, build_plan
from client.load_stats import Slo
from decode_server.config import DecodeConfig
from planner import attention_cost as attn
from planner import plan as sim_plan
from planner.cluster import Clock, DecodeServer, PrefillServer
from planner.costs import KV_BYTES_PER_TOKEN, RESULTS, profiled_engine
from planner.deployment import LOCAL_MODES, Deployment, Serving
from planner.fits import fit_costs
from planner.simulation import met, simulate, summarize
from planner.traffic import Conversations, SimRequest, Traffic
from planner.validate import SM_SPLIT_TABLE, prefill_sms, recorded_runs, table_sms, validate

COSTS = fit_costs()
SERVING = Serving(step_host_ms_per_seq=0.08, local_call_ms=2.0, remote_prefill_ms=4.0, join_local_ms=4.0,
                  join_remote_ms=6.0)
LOAD = LoadSpec(rate=4.0, duration=10.0, prompt_len="uniform:512:4096", output_len="uniform:16:128",
                long_prompt_frac=0.1, long_prompt_len=16384, background_users=4, seed=3)
CHAT = Conversations(turns="uniform:2:4", new_tokens="64", think_s=0.5)
EVERY_MODE = [Deployment(1, 1, "disaggregated"), Deployment(2, 3, "auto"),
              *(Deployment(0, 2, m, chunk_size=1024) for m in LOCAL_MODES)]


def test_fits_load_from_the_recorded_results() -> None:
    for fit in COSTS.fits():
        assert all(np.isfinite(fit.params)) and fit.points >= 3, fit.name
        assert fit.max_rel_error < 0.5, fit.line()
    assert COSTS.decode.r2 > 0.95 and COSTS.prefill.r2 > 0.99
    # the fitted costs grow as the work does
    assert COSTS.prefill_ms(32768) > COSTS.prefill_ms(4096) > COSTS.prefill_ms(512) > 0
    assert COSTS.decode_ms(64, 64 * 2048, 2048) > COSTS.decode_ms(1, 1024, 1024)
    slow, rate = COSTS.partition_factors(100)
    assert slow > COSTS.partition_factors(68)[0] > 1 and 0 < COSTS.partition_factors(68)[1] < rate < 1


def test_the_attention_model_is_the_engines_kernel() -> None:
    """The split kernel's geometry as the engine has it: the model's shape, the kernel's constants, the graphs'
    buckets and the number of splits each gets."""
    from engine.cuda_graphs import bucket_sizes
    from engine.presets import PRESETS

    shape = PRESETS["qwen2.5-7b"]
    assert (shape.num_layers, shape.num_kv_heads) == (attn.LAYERS, attn.KV_HEADS)
    assert 2 * shape.head_dim * 2 == attn.HEAD_BYTES_PER_TOKEN  # K and V, bf16
    assert attn.HEAD_BYTES_PER_TOKEN * attn.KV_HEADS * attn.LAYERS == KV_BYTES_PER_TOKEN
    source = (Path(__file__).parents[1] / "engine/kernels/paged_decode.py").read_text()
    constants = dict(re.findall(r"^(TARGET_PROGRAMS) = (\d+)", source, re.MULTILINE))
    # a 16-bit pool's tile is DecodeTile's default (an e4m3 pool has its own, which the model does not price)
    constants.update(re.findall(r"^    (block_n): int = (\d+)", source, re.MULTILINE))
    assert constants == {"block_n": str(attn.BLOCK_N), "TARGET_PROGRAMS": str(attn.ENGINE_TARGET_PROGRAMS_NOW)}
    for top in (1, 8, 40, 64, 256):
        graphs = bucket_sizes(top, 1)
        assert [attn.bucket_for(n, top) for n in range(1, top + 1)] == [min(b for b in graphs if b >= n)
                                                                       for n in range(1, top + 1)]
    # 264 programs over bucket x 4 KV heads, up to a power of two (paged_decode.num_splits_for)
    assert [attn.num_splits(b) for b in (1, 2, 4, 8, 16, 24, 32, 48, 64)] == [64, 64, 16, 8, 4, 2, 2, 1, 1]


def test_attention_follows_the_longest_context() -> None:
    """The same tokens cost more in one long history than spread evenly, and more in a larger batch's bucket
    (fewer splits, so a longer program); the fit reproduces the profile it came from."""
    model = COSTS.attention_model
    even = model.step_ms(32, 1024, 32 * 1024)
    one_long = model.step_ms(32, 16384 + 64, 32 * 1024)
    assert one_long > 5 * even
    assert model.step_ms(48, 16384, 48 * 1024) > 1.8 * model.step_ms(16, 16384, 16 * 1024)
    profile = profiled_engine(RESULTS)["decode_profile"]
    for batch, kernels in profile.items():
        measured = next(k["us_per_step"] for k in kernels if k["kernel"] == "_split_kernel") / 1e3
        b = int(batch)
        assert model.step_ms(b, attn.ENGINE_CONTEXT, b * attn.ENGINE_CONTEXT) == pytest.approx(measured, rel=0.05)
    assert 8 < model.program_gbps < 20  # one program's loop is latency-bound, far below HBM's 4,200 GB/s


def test_a_long_history_slows_every_step_it_is_in() -> None:
    """A decode server's step is priced by its longest running context: 8 sequences decode together, one of
    them a 16k history; while it runs every step takes what the model gives for it, and after it is done
    the others' steps are short again."""
    clock, done = Clock(), list[SimRequest]()
    server = DecodeServer(0, clock, COSTS, Deployment(0, 1, "colocated"), Serving(), [], done.append)
    lengths = [(1024, 40)] * 7 + [(16384, 20)]
    for i, (prompt, output) in enumerate(lengths):
        server._ready(SimRequest(f"r{i}", "arrival", 0.0, prompt, output, first_token=0.0))
    clock.run()
    gaps = np.diff([0.0, *server.step_ends]) * 1e3
    assert len(done) == 8 and len(gaps) == 39
    context = 7 * 1025 + 16385
    assert gaps[0] == pytest.approx(COSTS.decode_ms(8, context, 16385))
    assert gaps[18] == pytest.approx(COSTS.decode_ms(8, context + 18 * 8, 16385 + 18))
    assert gaps[19] == pytest.approx(COSTS.decode_ms(7, 7 * (1025 + 19), 1025 + 19))
    assert gaps[:19].min() > 1.3 * gaps[19:].max()  # all 16k tokens at HBM bandwidth would add 0.2 ms


def test_a_long_program_reads_most_of_its_history_alone_on_its_sm() -> None:
    """The longest program shares its SM at the profile's rate for as long as the batch's mean program runs, and
    reads the rest alone at the rate `bench.micro.decode_attention` measured with one program an SM; equal contexts (the
    profile the shared rate was fitted to) are priced as before."""
    model = COSTS.attention_model
    assert COSTS.attention_alone is not None and model.alone_gbps is not None
    assert 15 < model.alone_gbps < 20 and model.alone_gbps > model.program_gbps
    shared_only = dataclasses.replace(model, alone_gbps=None)
    for b in (1, 8, 32, 64):
        assert model.step_ms(b, 1024, b * 1024) == pytest.approx(shared_only.step_ms(b, 1024, b * 1024))
    # a 16k history among 31 of 1k: bucket 32, two splits, so 8k tokens a program, 512 of them beside another
    total = 31 * 1024 + 16384
    splits = attn.num_splits(attn.bucket_for(32))
    program = attn.split_tokens(16384, splits) * attn.HEAD_BYTES_PER_TOKEN
    mean = attn.split_tokens(-(-total // 32), splits) * attn.HEAD_BYTES_PER_TOKEN
    expected = attn.LAYERS * (model.launch_us + mean / (model.program_gbps * 1e3)
                              + (program - mean) / (model.alone_gbps * 1e3)) / 1e3
    assert model.step_ms(32, 16384, total) == pytest.approx(expected)
    assert model.step_ms(32, 16384, total) < 0.8 * shared_only.step_ms(32, 16384, total)


def test_the_lone_program_fit_takes_every_attention_sweep(tmp_path: Path) -> None:
    """The lone rate is fitted to the rows of every `decode-attention*.json` whose grid has at most one program an
    SM; a sweep of longer contexts (python -m bench.micro.decode_attention --contexts 16384 ...) joins as its own
    file."""
    from planner.fits import fit_attention_alone

    assert fit_attention_alone(tmp_path) is None
    recorded = json.loads((RESULTS / "decode-attention-h200.json").read_text())
    (tmp_path / "decode-attention-h200.json").write_text(json.dumps(recorded))
    alone = fit_attention_alone(tmp_path)
    assert alone is not None and alone.points == 20 and alone.r2 > 0.98
    # a synthetic 16k sweep at 10 GB/s a program: rows of one program an SM pull the rate down, others are left out
    rows = [{"context": 16384, "batch": b, "splits": s,
             "us": 4.0 + attn.split_tokens(16384, s) * attn.HEAD_BYTES_PER_TOKEN / 10e3}
            for b in (1, 8, 64) for s in (1, 2)]
    (tmp_path / "decode-attention-16k-h200.json").write_text(json.dumps({"rows": rows}))
    longer = fit_attention_alone(tmp_path)
    assert longer is not None and longer.points == 20 + 4  # batch 64 is 256 programs or more: not alone
    assert 1.0 / (longer.params[1] * 1e3) < 1.0 / (alone.params[1] * 1e3)


def test_the_servers_local_prefill_is_the_engines_times_a_factor(tmp_path: Path) -> None:
    """Colocated scenario rows that run 2% over the engine's prefill at every length give a factor of 1.02, so a
    150-token turn is charged 2% more, not the milliseconds that 2% of a 32k prompt is."""
    from planner.fits import fit_local_factor, fit_prefill

    prefill = fit_prefill(RESULTS)
    p0, p1, p2 = prefill.params
    rows = [{"mode": "colocated", "b_len": t, "b_ttft_ms": 1.02 * (p0 + p1 * t + p2 * t * t)}
            for t in (4096, 16384, 32768)]
    for name in ("scenario-h200.json", "scenario-2xh200.json", "scenario-layered-2xh200.json"):
        (tmp_path / name).write_text(json.dumps({"rows": rows if name == "scenario-h200.json" else []}))
    factor = fit_local_factor(tmp_path, prefill)
    assert factor.params[0] == pytest.approx(1.02) and factor.points == 3
    costs = dataclasses.replace(COSTS, local_factor=factor)
    assert costs.local_prefill_ms(150) == pytest.approx(1.02 * costs.prefill_ms(150))
    assert costs.local_prefill_ms(150) - costs.prefill_ms(150) < 0.5  # where 2% of a 32k prefill is ~20 ms


def test_the_long_history_rows_price_the_rest_of_the_longest_program(tmp_path: Path) -> None:
    """Where `bench.micro.decode_attention --long-context` rows exist, the rest of a long history's program is priced at
    the rate they give at the split counts the kernel picked (its other rows are not a step the engine runs), and
    the model takes that rate, not the lone one."""
    from planner.costs import attention_model_of
    from planner.fits import fit_long_history

    assert fit_long_history(tmp_path, COSTS.attention) is None
    launch_us, us_per_byte = COSTS.attention.params
    rows = []
    for batch, splits, chosen in ((8, 8, True), (24, 2, True), (24, 1, False)):
        tokens = (batch - 1) * 1024 + 16384
        program = attn.split_tokens(16384, splits) * attn.HEAD_BYTES_PER_TOKEN
        shared = min(program, attn.split_tokens(-(-tokens // batch), splits) * attn.HEAD_BYTES_PER_TOKEN)
        us = launch_us + shared * us_per_byte + (program - shared) / (10e3 if chosen else 1e3)  # 10 or 1 GB/s
        rows.append({"context": 1024, "batch": batch, "long_context": 16384, "splits": splits, "us": us,
                     "engine_choice": chosen})
    (tmp_path / "attention-long-history-h200.json").write_text(json.dumps({"rows": rows}))
    fit = fit_long_history(tmp_path, COSTS.attention)
    assert fit is not None and fit.points == 2
    model = attention_model_of(COSTS.attention, COSTS.hbm_gbps, COSTS.attention_alone, fit)
    assert model.alone_gbps == pytest.approx(10.0)
    recorded = fit_long_history(RESULTS, COSTS.attention)
    assert recorded is not None and COSTS.attention_model.alone_gbps == pytest.approx(1.0 / (recorded.params[0] * 1e3))


def test_a_shape_measured_again_replaces_the_earlier_row(tmp_path: Path) -> None:
    """A later sweep of the same (context, batch, splits) replaces the earlier row in the lone-program fit
    (decode-attention-b1-h200.json re-read batch 1 from HBM where the first sweep's layers sat in L2)."""
    from planner.fits import attention_sweep_rows, fit_attention_alone

    recorded = json.loads((RESULTS / "decode-attention-h200.json").read_text())
    (tmp_path / "decode-attention-h200.json").write_text(json.dumps(recorded))
    first = fit_attention_alone(tmp_path)
    again = [{**r, "us": 2 * r["us"]} for r in recorded["rows"] if r["batch"] == 1]
    (tmp_path / "decode-attention-zz-h200.json").write_text(json.dumps({"date": "2000-01-01", "rows": again}))
    rows = attention_sweep_rows(tmp_path)
    assert len(rows) == len(recorded["rows"])  # replaced, not added: the older date loses whatever the file name
    assert first is not None and (second := fit_attention_alone(tmp_path)) is not None
    assert second.points == first.points and second.params[1] == pytest.approx(first.params[1])
    (tmp_path / "decode-attention-zz-h200.json").write_text(json.dumps({"date": "2099-01-01", "rows": again}))
    later = fit_attention_alone(tmp_path)
    assert later is not None and later.points == first.points and later.params[1] > first.params[1]


def test_the_lone_program_fit_reads_the_engines_tile_on_a_16_bit_pool_only(tmp_path: Path) -> None:
    """A later sweep of an e4m3 pool, or of tiles the engine did not run, times other kernels: it replaces no row."""
    from planner.fits import attention_sweep_rows, fit_attention_alone

    recorded = json.loads((RESULTS / "decode-attention-h200.json").read_text())
    (tmp_path / "decode-attention-h200.json").write_text(json.dumps(recorded))
    first = fit_attention_alone(tmp_path)
    batch_one = [r for r in recorded["rows"] if r["batch"] == 1]
    tile = {"kv_dtype": "bf16", "block_n": 64, "num_stages": 2, "num_warps": 4}
    other = [{**r, **tile, "kv_dtype": "fp8", "us": 2 * r["us"]} for r in batch_one]
    other += [{**r, **tile, "block_n": 32, "us": 3 * r["us"], "engine_choice": False} for r in batch_one]
    other += [{**r, **tile, "us": r["us"], "engine_choice": False} for r in batch_one[:1]]  # the engine's tile
    other[-1]["engine_choice"] = True
    (tmp_path / "decode-attention-zz-h200.json").write_text(json.dumps({"date": "2099-01-01", "rows": other}))
    rows = attention_sweep_rows(tmp_path)
    assert len(rows) == len(recorded["rows"])
    assert not any(r.get("kv_dtype") == "fp8" or r.get("block_n") == 32 for r in rows)
    assert sum(r.get("block_n") == 64 for r in rows) == 1  # the engine's tile replaced its shape's row
    later = fit_attention_alone(tmp_path)
    assert first is not None and later is not None and later.params == pytest.approx(first.params, rel=0.05)


@pytest.mark.parametrize("deployment", [Deployment(1, 1, "disaggregated"), Deployment(0, 1, "partitioned")],
                         ids=lambda d: d.label())
def test_a_prompt_prefilled_elsewhere_waits_for_the_step_under_way(deployment: Deployment) -> None:
    """The engine thread reads its inbox when an iteration begins: a prompt prefilled off it (a prefill
    server's KV, a partitioned prefill) has its first token go out at the end of the decode step that was
    running when it was done, never in the middle of one."""
    load = dataclasses.replace(LOAD, background_users=8, long_prompt_frac=0.0)
    result = simulate(deployment, COSTS, load, SERVING)
    ends = set(result.step_ends[0].tolist())
    later = [r for r in result.requests if r.finished and r.first_token > 1.0]  # once the batch runs
    assert later and sum(r.first_token in ends for r in later) >= 0.9 * len(later)


@pytest.mark.parametrize("deployment", [Deployment(1, 1, "disaggregated"), Deployment(0, 1, "colocated")],
                         ids=lambda d: d.label())
def test_a_join_cost_moves_the_mean_tpot_it_is_calibrated_on(deployment: Deployment) -> None:
    """`calibrate` prices a sequence's admission from the training run's mean TPOT, which every admission adds
    to: the figure has to rise with the cost, or the fixed point would walk away (as it did on the 90th
    percentile gap, which a step with a long history decides)."""
    def mean_tpot(join_ms: float) -> float:
        serving = dataclasses.replace(SERVING, join_remote_ms=join_ms, join_local_ms=join_ms)
        done = [r for r in simulate(deployment, COSTS, LOAD, serving).requests if r.finished and r.tpot is not None]
        return sum(r.tpot for r in done if r.tpot is not None) / len(done)

    assert mean_tpot(0.0) < mean_tpot(3.0) < mean_tpot(6.0)


def test_a_prefill_server_takes_the_next_prompt_once_its_sends_are_done() -> None:
    """The prefill worker waits for its last sends (`sender.finish()`), not for the decode side to finish the
    handoff: the next prompt's compute overlaps the rest of the last one's handoff, so two prompts queued
    together land one prefill plus that wait apart, and the backlog the server reports empties as jobs end."""
    assert 0 < COSTS.prefill_server_hold_ms(2048) < COSTS.kv_handoff_ms(2048)
    clock = Clock()
    server = PrefillServer(clock, COSTS, SERVING)
    landed: dict[str, float] = {}
    first, second = (SimRequest(key, "arrival", 0.0, 2048, 8) for key in ("a", "b"))
    for request in (first, second):
        server.submit(request, lambda r=request: landed.__setitem__(r.key, clock.now))  # type: ignore[misc]
    assert server.backlog_tokens == 2 * 2048
    clock.run()
    assert landed["a"] == pytest.approx(first.prefill_s + COSTS.kv_handoff_ms(2048) / 1e3)
    assert landed["b"] - landed["a"] == pytest.approx(second.prefill_s + COSTS.prefill_server_hold_ms(2048) / 1e3)
    assert server.backlog_tokens == 0 and server.backlog == 0


def test_a_clients_next_request_finds_the_engine_under_way() -> None:
    """A background user's next request leaves when its last one is done (its last token out), not before;
    and a conversation's next turn, sent in answer to a last token, waits for the iteration the engine
    began meanwhile: on a busy server its TTFT is longer than its prefill."""
    spec = dataclasses.replace(LOAD, background_users=4)
    result = simulate(Deployment(0, 1, "colocated"), COSTS, spec, SERVING, Conversations(turns="3", new_tokens="64"))
    by_user: dict[int, list[SimRequest]] = {}
    for r in result.requests:
        if r.user is not None:
            by_user.setdefault(r.user, []).append(r)
    assert by_user and all(b.sent == a.done for rs in by_user.values() for a, b in zip(rs, rs[1:], strict=False))
    later = [r for r in result.requests if r.turn > 0 and r.sent < spec.duration]
    assert later and all(r.ttft > r.prefill_s for r in later)


def test_missing_results_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="restore bench/results"):
        fit_costs(tmp_path)


def test_traffic_is_client_loads_plan() -> None:
    plan, traffic = build_plan(LOAD), Traffic(LOAD)
    assert [(a.at, len(a.token_ids), a.output_len) for a in plan.arrivals] == \
        [(r.sent, r.prompt, r.output) for r in traffic.arrivals]
    for user in range(LOAD.background_users):  # each background user's requests, in order, are client.load's
        for _ in range(3):
            mine, theirs = traffic.background(user, 0.0), plan.users[user].next()
            assert (mine.prompt, mine.output) == (len(theirs.token_ids), theirs.output_len)


@pytest.mark.parametrize("deployment", EVERY_MODE, ids=lambda d: d.label())
def test_every_request_finishes_with_all_its_tokens(deployment: Deployment) -> None:
    result = simulate(deployment, COSTS, LOAD, SERVING, CHAT)
    requests = result.requests
    assert requests and all(r.finished for r in requests)
    assert all(r.sent <= r.first_token <= r.done for r in requests)
    assert len({r.key for r in requests}) == len(requests)
    gaps = result.itl_s()
    assert len(gaps) == sum(r.output - 1 for r in requests) and (gaps > 0).all()
    for server, ends in enumerate(result.step_ends):  # a server's decode steps end in order
        assert (np.diff(ends) > 0).all(), server


@pytest.mark.parametrize("deployment", EVERY_MODE[:3], ids=lambda d: d.label())
def test_same_seed_same_run(deployment: Deployment) -> None:
    runs = [simulate(deployment, COSTS, LOAD, SERVING, CHAT) for _ in range(2)]
    a, b = ([(r.key, r.server, r.first_token, r.done) for r in run.requests] for run in runs)
    assert a == b
    other = simulate(deployment, COSTS, dataclasses.replace(LOAD, seed=4), SERVING, CHAT)
    assert [r.prompt for r in other.requests] != [r.prompt for r in runs[0].requests]


@pytest.mark.parametrize("mode", ["colocated", "layered", "disaggregated"])
def test_more_decode_gpus_never_lower_goodput(mode: str) -> None:
    """At one open-loop load, the requests within the SLO (goodput's count; the run's end time moves by a
    last request's few ms) never fall as decode servers are added, and the load is heavy enough to gain."""
    load = dataclasses.replace(LOAD, rate=24.0, background_users=0, output_len="uniform:64:256")
    slo = Slo(ttft_ms=1000, itl_ms=20)
    prefill = 4 if mode == "disaggregated" else 0
    within = [sum(met(r, slo) for r in simulate(Deployment(prefill, d, mode), COSTS, load, SERVING).requests)
              for d in (1, 2, 3, 4)]
    assert within == sorted(within) and within[-1] > within[0], within


def test_later_turns_hit_the_prefix_cache() -> None:
    result = simulate(Deployment(0, 2, "colocated"), COSTS, dataclasses.replace(LOAD, background_users=0), SERVING,
                      Conversations(turns="3", new_tokens="32"))
    later = [r for r in result.requests if r.turn > 0]
    assert later and all(r.cached == r.history for r in later)  # sticky routing: the history is where it went
    first = {r.conversation: r for r in result.requests if r.turn == 0}
    assert all(r.prefill_s < first[r.conversation].prefill_s + 0.05 for r in later)
    assert all(r.prompt - r.cached == 32 for r in later)


def test_auto_follows_the_decode_servers_rule() -> None:
    """The decode server's own rule and defaults: a short prompt local, a long one remote while the
    prefill servers' backlog is small."""
    deployment = Deployment(2, 2, "auto")
    assert deployment.auto_local_tokens == DecodeConfig().auto_local_tokens
    result = simulate(deployment, COSTS, dataclasses.replace(LOAD, rate=1.0, background_users=2), SERVING)
    assert all(r.where == "local" for r in result.requests if r.prompt <= deployment.auto_local_tokens)
    long = [r for r in result.requests if r.prompt >= 4096]
    assert long and all(r.where == "remote" for r in long)


def test_auto_counts_its_own_remote_prefills_until_their_kv_lands() -> None:
    """The decode server weighs its own remote prefills in flight (from placement until the KV has landed) or the
    prefill servers' reported backlog, whichever is more: a prompt whose job is done on the prefill server but whose
    handoff is still under way keeps counting."""
    clock = Clock()
    deployment = Deployment(1, 1, "auto", auto_remote_backlog_tokens=4096)
    prefill = PrefillServer(clock, COSTS, SERVING)
    server = DecodeServer(0, clock, COSTS, deployment, SERVING, [prefill], lambda r: None)
    first = SimRequest("a", "arrival", 0.0, 8192, 8)
    server.submit(first)
    assert first.where == "remote" and server.remote_backlog_tokens == prefill.backlog_tokens == 8192
    prefill.backlog_tokens = 0  # its job is done (PrefillServer._finished); the handoff is not
    server.running = 1  # somebody decodes here
    second = SimRequest("b", "arrival", 0.0, 2048, 8)
    assert server._placement(second) == deployment.auto_local
    server._kv_arrived(first, 8192)
    assert server.remote_backlog_tokens == 0 and server._placement(second) == "disaggregated"


def test_slo_counts_like_client_load() -> None:
    result = simulate(Deployment(0, 1, "colocated"), COSTS, LOAD, SERVING)
    slo = Slo(ttft_ms=200, itl_ms=20)
    summary = summarize(result, slo)
    assert summary["goodput_rps"] == round(sum(met(r, slo) for r in result.requests) / result.duration_s, 3)
    assert summarize(result, Slo())["goodput_rps"] == summary["request_throughput"]


def test_validation_rows_cover_every_recorded_load_run() -> None:
    runs = recorded_runs(RESULTS)
    assert {r.file for r in runs} >= {"load-h200.json", "load-2xh200.json"}
    record = validate(RESULTS, progress=False)
    rows = record["validation"]
    assert len(rows) == 3 * len(runs)
    assert {r["metric"] for r in rows} == {"goodput_rps", "ttft_ms.p50", "itl_ms.p99"}
    for row in rows:
        assert row["rel_error"] == pytest.approx((row["simulated"] - row["measured"]) / row["measured"], abs=1e-4)


def test_a_load_run_of_another_preset_is_not_replayed() -> None:
    """The costs are the bf16 engine's: the FP8 preset's load runs (faster steps and prefills) would be scored
    against them, so they are left out, each record by its own preset."""
    from planner.validate import _records

    fp8 = json.loads((RESULTS / "load-fp8-h200.json").read_text())
    assert fp8["preset"] == "qwen2.5-7b-fp8" and not list(_records(fp8, "load-fp8-h200.json"))
    as_bf16 = {**fp8, "preset": "qwen2.5-7b", "previous": None}
    assert len(list(_records(as_bf16, "load-fp8-h200.json"))) == len(fp8["runs"])
    assert not any(r.file == "load-fp8-h200.json" for r in recorded_runs(RESULTS))


def test_merged_runs_are_replayed_with_their_own_load_and_cache() -> None:
    """bench.e2e.deployments --merge keeps each run's own parameters: the cache comparison replays as four-turn
    conversations, one decode server with its prefix cache and one without."""
    runs = {(r.name, r.commit): r for r in recorded_runs(RESULTS) if r.file == "load-h200.json"}
    cached, plain = runs["prefix-cache", "1b5989d"], runs["no-prefix-cache", "1b5989d"]
    assert cached.spec.turns == plain.spec.turns == 4
    assert cached.deployment.prefix_cache and not plain.deployment.prefix_cache
    assert not runs["colocated", "c40eebd"].deployment.prefix_cache  # its server had --no-prefix-cache


def test_without_the_prefix_cache_later_turns_prefill_everything() -> None:
    spec = dataclasses.replace(LOAD, rate=1.0, background_users=0)
    off = simulate(Deployment(0, 1, "colocated", prefix_cache=False), COSTS, spec, SERVING, CHAT)
    on = simulate(Deployment(0, 1, "colocated"), COSTS, spec, SERVING, CHAT)
    assert all(r.cached == 0 for r in off.requests)
    assert any(r.cached > 0 for r in on.requests if r.turn > 0)


def test_partitioned_runs_replay_the_servers_sm_split() -> None:
    """A partitioned run is replayed on the SMs its decode server gave the prefill: --prefill-sms, else the most
    SMs its table keeps within --itl-slo-ms (decode_server.sm_split), not the simulator's default."""
    from decode_server.sm_split import SplitTable

    server = "python -m decode_server --preset qwen2.5-7b --mode colocated --port 50071"
    table = SplitTable.load(SM_SPLIT_TABLE)
    assert prefill_sms([server]) == table.pick(None)[0]
    assert prefill_sms([server + " --itl-slo-ms 30"]) == table.pick(30.0)[0] != table.pick(None)[0]
    assert prefill_sms([server + " --prefill-sms 96"]) == 96
    runs = [r for r in recorded_runs(RESULTS) if r.deployment.mode == "partitioned"]
    assert runs and all(r.deployment.partition_sms == table.pick(None)[0] != Deployment.partition_sms for r in runs)
    replayed = [r for r in validate(RESULTS, progress=False)["runs"] if r["deployment"].startswith("partitioned")]
    assert len(replayed) == len(runs) and all(r["prefill_sms"] == table.pick(None)[0] for r in replayed)


def test_the_plan_prices_partitioned_on_the_servers_sm_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's partitioned deployments run on the SMs a decode server without --prefill-sms picks from its table
    with the mix's TPOT limit as --itl-slo-ms (its default pick without one), not the simulator's default."""
    from decode_server.sm_split import SplitTable

    priced: list[Deployment] = []

    def goodput(deployment: Deployment, *args: object, **kwargs: object) -> float:
        priced.append(deployment)
        return 1.0

    monkeypatch.setattr(sim_plan, "goodput", goodput)
    table = SplitTable.load(SM_SPLIT_TABLE)
    no_tpot = dataclasses.replace(sim_plan.MIXES["chat"], slo=Slo(ttft_ms=1000))
    for mix in [*sim_plan.MIXES.values(), no_tpot]:
        priced.clear()
        rows = sim_plan.plan(2, mix, COSTS, SERVING)
        want = table.pick(mix.slo.itl_ms)[0]
        assert want != Deployment.partition_sms
        assert [d.partition_sms for d in priced if d.mode == "partitioned"] == [want]
        assert [r.get("prefill_sms") for r in rows if r["mode"] == "partitioned"] == [want]
        assert all("prefill_sms" not in r for r in rows if r["mode"] != "partitioned")
    priced.clear()  # --plan-sms: a comparison on a count of the caller's choosing
    rows = sim_plan.plan(2, sim_plan.MIXES["chat"], COSTS, SERVING, partition_sms=96)
    assert [d.partition_sms for d in priced if d.mode == "partitioned"] == [96]
    assert [r.get("prefill_sms") for r in rows if r["mode"] == "partitioned"] == [96]
    assert table.pick(None)[0] == 72 and table.pick(50.0)[0] == table.pick(30.0)[0] == 80  # as docs/scaling.md says


def test_the_recorded_plan_ran_partitioned_on_the_table_pick() -> None:
    plans = json.loads((RESULTS / "simulate-plan.json").read_text())["plans"]
    for name, entry in plans.items():
        partitioned = [r for r in entry["rows"] if r["mode"] == "partitioned"]
        assert [r.get("prefill_sms") for r in partitioned] == [table_sms(entry["slo"]["itl_ms"])], name


# --- the network between nodes --------------------------------------------------------------------
def test_a_handoff_between_nodes_is_priced_at_the_nic_rate() -> None:
    """A 32k prompt's 1.88 GB of KV crosses a 400 Gb/s NIC (50 GB/s) in 37.6 ms: all of it exposed when nothing
    hides it, one layer's 1.34 ms when a long prefill does. On NVLink's measured rate it would be several times
    less."""
    from planner.network import Network

    kv_bytes = 32768 * KV_BYTES_PER_TOKEN
    assert kv_bytes == pytest.approx(1.879e9, rel=1e-3)
    nic = Network(nic_gbps=400, nic_latency_us=5)
    assert nic.nic_exposed_ms(32768, compute_ms=0) == pytest.approx(kv_bytes / 50e9 * 1e3 + 0.005)
    assert nic.nic_exposed_ms(32768, compute_ms=1e4) == pytest.approx(kv_bytes / 28 / 50e9 * 1e3 + 0.005)
    nvlink_ms = kv_bytes / (COSTS.kv.params[0] * 1e9) * 1e3
    assert COSTS.kv.params[0] > 150 and nic.nic_exposed_ms(32768, 0) > 3 * nvlink_ms
    assert Network(nic_gbps=800).nic_exposed_ms(32768, 0) == pytest.approx(kv_bytes / 100e9 * 1e3 + 0.005)


def test_a_prefill_server_prices_the_handoff_by_where_its_decode_server_is() -> None:
    """The same prompt lands the measured NVLink handoff after its prefill for a decode server on the prefill
    server's node, and the servers' part plus what a 10 Gb/s NIC cannot hide behind the prefill for one on another
    node; only what the decode server lacks crosses the NIC."""
    from planner.network import Network, control_ms

    network = Network(nic_gbps=10, nic_latency_us=0)
    landed: dict[str, float] = {}
    for key, node, decode_cached in (("same", 0, 0), ("other", 1, 0), ("other, half cached", 1, 16384)):
        clock = Clock()
        server = PrefillServer(clock, COSTS, SERVING, node=0, network=network)
        request = SimRequest(key, "arrival", 0.0, 32768, 8)
        server.submit(request, lambda k=key, c=clock: landed.__setitem__(k, c.now),  # type: ignore[misc]
                      node, decode_cached)
        clock.run()
        landed[key] -= request.prefill_s
    compute_ms = COSTS.prefill_ms(32768)
    assert landed["same"] == pytest.approx(COSTS.kv_handoff_ms(32768) / 1e3)
    layer_ms = 32768 * KV_BYTES_PER_TOKEN / 28 / 1.25e9 * 1e3  # 10 Gb/s = 1.25 GB/s
    assert layer_ms > compute_ms / 28  # the NIC is slower than the prefill: the pipeline backs up
    exposed = layer_ms + 27 * (layer_ms - compute_ms / 28)
    assert landed["other"] == pytest.approx((control_ms(COSTS, 32768) + exposed) / 1e3)
    assert landed["same"] < landed["other, half cached"] < landed["other"]


def test_per_node_pools_keep_each_nodes_kv_on_it() -> None:
    from planner.cluster import Cluster
    from planner.network import Network, node_layout

    assert node_layout("per-node", 2, 14, 8) == ([0, 1], [0] * 7 + [1] * 7)
    assert node_layout("split-nodes", 10, 6, 8) == ([0] * 8 + [1] * 2, [2] * 6)
    with pytest.raises(ValueError, match="whole nodes of 8 GPUs"):
        node_layout("per-node", 3, 13, 8)
    cluster = Cluster(Deployment(2, 6, "disaggregated", pools="per-node"), COSTS, Traffic(LOAD, Conversations()),
                      SERVING, Network(gpus_per_node=4))
    for server in cluster.decode:
        assert [p.node for p in server.prefill_servers] == [server.node]
    shared = Cluster(Deployment(2, 6, "disaggregated", pools="split-nodes"), COSTS, Traffic(LOAD, Conversations()),
                     SERVING, Network(gpus_per_node=4))
    assert [s.node for s in shared.decode] == [1, 1, 1, 1, 2, 2]
    assert all(len(s.prefill_servers) == 2 for s in shared.decode)


def test_the_flip_is_the_slowest_nic_from_which_split_nodes_keep_winning() -> None:
    from planner.network_plan import flip_gbps

    assert flip_gbps(10.0, {100.0: 8.0, 400.0: 10.0, 1600.0: 11.0}) == 400.0
    assert flip_gbps(10.0, {100.0: 8.0, 400.0: 9.0}) is None
    assert flip_gbps(10.0, {100.0: 12.0, 400.0: 9.0, 1600.0: 12.0}) == 1600.0


def test_a_faster_nic_moves_the_answer_towards_split_nodes() -> None:
    """Two nodes of two GPUs under long prompts: per-node (1P+1D on each) against the prefill pool on one node and
    the decode pool on the other. The split pools' goodput only grows with the NIC; on a NIC slower than the
    prefill per-node wins, and on a fast one the shared prefill pool at least matches it."""
    from planner.network import Network
    from planner.network_plan import compare
    from planner.plan import Mix

    mix = Mix("long", LoadSpec(duration=8, prompt_len="uniform:16384:32768", output_len="lognormal:100:0.5", seed=5),
              Conversations(), Slo(ttft_ms=4000, itl_ms=50), "long prompts")
    result = compare(4, mix, COSTS, SERVING, Network(gpus_per_node=2), (2.0, 25.0, 1600.0), duration=8)
    best = result["per_node_best"]["goodput_rps"]
    split = [result["split_nodes_best"][k] for k in ("2", "25", "1600")]
    assert split == sorted(split) and split[0] < best <= split[-1], result
    assert result["flip_nic_gbps"] in (25.0, 1600.0)


@pytest.mark.parametrize(("flags", "says"), [
    (["--nic-gbps", "0"], "positive NIC rate"),
    (["--pools", "per-node", "--prefill", "3", "--decode", "5", "--gpus-per-node", "4"], "whole nodes of 4 GPUs"),
])
def test_a_network_the_planner_cannot_price_is_refused(flags: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from planner.__main__ import main

    with pytest.raises(SystemExit):
        main(flags)
    assert says in capsys.readouterr().err
