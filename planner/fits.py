"""The simulator's costs fitted to the recorded measurements in bench/results (`fit_costs`), one fit a
cost, each with its quality, and the lines `python -m planner` prints about them (`describe`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from planner.attention_cost import ENGINE_CONTEXT, AttentionModel, alone_points, attention_points, longest_program_bytes
from planner.costs import (
    ATTENTION_SWEEPS,
    LATER_TURNS,
    LONG_HISTORY,
    PARTITION_ALONE_STEP_MS,
    PARTITION_LAB,
    PRESET,
    RESULTS,
    Costs,
    Fit,
    attention_model_of,
    engine_runs,
    layered_slices,
    least_squares,
    load_result,
    profiled_engine,
    scenario_rows,
)


def fit_attention(results: Path) -> Fit:
    """The split kernel's time a layer against its longest program's bytes (bench.micro.engine_steps's profile)."""
    x, y = attention_points(profiled_engine(results))
    return least_squares("decode attention a layer (a0 + a1*bytes)", x, y)


def attention_sweep_rows(results: Path) -> list[dict[str, Any]]:
    """Every `bench.micro.decode_attention` file's rows of equal contexts, a shape (context, batch, splits) measured
    again in a later file replacing the earlier row (decode-attention-b1-h200.json: batch 1 re-read from HBM
    where the first sweep's layers fit in L2). Only the recorded runs' own kernel counts: a 16-bit pool (the
    preset's) and, in a file that sweeps tiles, the tile the engine ran (the one its `engine_choice` rows name)."""
    docs = [json.loads(path.read_text()) for path in results.glob(ATTENTION_SWEEPS)]
    docs.sort(key=lambda doc: doc.get("date", ""))
    rows = {(r["context"], r["batch"], r["splits"]): r for doc in docs for r in _engine_tile_rows(doc["rows"])
            if "long_context" not in r and r.get("kv_dtype", "bf16") == "bf16"}
    return list(rows.values())


def _tile(row: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(row.get(key) for key in ("kv_dtype", "block_n", "num_stages", "num_warps", "max_registers"))


def _engine_tile_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows timed with a tile the engine ran: every split count of it, not only the count it picks. A row
    that names no tile is from a sweep of the engine's alone."""
    engine = {_tile(r) for r in rows if r.get("engine_choice")}
    return [r for r in rows if "block_n" not in r or _tile(r) in engine]


def fit_long_history(results: Path, attention: Fit) -> Fit | None:
    """The rest of a long history's program (its bytes beyond what the batch's mean program holds) against what the
    layer took beyond the model's launch and shared part, at the split counts the kernel picked (`engine_choice`):
    the case the simulator prices. None without such rows."""
    launch_us, us_per_byte = attention.params
    xs, ys = [], []
    for path in sorted(results.glob(LONG_HISTORY)):
        for r in json.loads(path.read_text())["rows"]:
            if not r["engine_choice"]:
                continue
            batch, longest = int(r["batch"]), int(r["long_context"])
            tokens = (batch - 1) * int(r["context"]) + longest
            program, shared = longest_program_bytes(longest, tokens, batch, int(r["splits"]))
            xs.append([float(program - shared)])
            ys.append(float(r["us"]) - launch_us - shared * us_per_byte)
    if not ys:
        return None
    return least_squares("long history's rest (b1*bytes)", np.array(xs), np.array(ys))


def fit_attention_alone(results: Path) -> Fit | None:
    """A program of the split kernel alone on its SM, against its bytes: the sweeps' rows whose grid has at most
    one program an SM (1k and 4k contexts, and 16k as a file of its own). None without three such rows."""
    x, y = alone_points(attention_sweep_rows(results))
    if len(y) < 3 or np.linalg.matrix_rank(x) < 2:
        return None
    return least_squares("attention program alone (b0 + b1*bytes)", x, y)


def fit_decode(results: Path, attention: AttentionModel) -> Fit:
    """The step beyond its attention, over every engine run's batches (each run's graphs go up to its largest)."""
    rows = [(int(b), ms, max(map(int, run["decode_ms"])), int(run.get("context", ENGINE_CONTEXT)))
            for run in engine_runs(results) for b, ms in run["decode_ms"].items()]
    attn = np.array([attention.step_ms(b, ctx, b * ctx, top) for b, _, top, ctx in rows])
    x = np.array([[1.0, b] for b, _, _, _ in rows])
    y = np.array([ms for _, ms, _, _ in rows]) - attn
    fit = least_squares("decode step (d0 + d1*batch + attention)", x, y)
    return _requality(fit, x, y, offset=attn)


def _requality(fit: Fit, x: np.ndarray, y: np.ndarray, offset: np.ndarray) -> Fit:
    """Quality of a fit whose target had a known term taken out, measured on the whole quantity."""
    whole, predicted = y + offset, x @ np.array(fit.params) + offset
    ss_tot = float(((whole - whole.mean()) ** 2).sum())
    r2 = 1.0 - float(((whole - predicted) ** 2).sum()) / ss_tot if ss_tot > 0 else math.nan
    return Fit(fit.name, fit.params, r2, float(np.max(np.abs(predicted - whole) / whole)), fit.points)


def fit_prefill(results: Path) -> Fit:
    rows = [(int(t), ms) for run in engine_runs(results) for t, ms in run.get("prefill_ms", {}).items()]
    x = np.array([[1.0, t, t * t] for t, _ in rows])
    return least_squares("prefill (p0 + p1*T + p2*T^2)", x, np.array([ms for _, ms in rows]))


def fit_chunk(results: Path, step_ms: float) -> Fit:
    """From the scenario: B's TTFT with chunks of c = its chunks plus A's one-sequence decode step after each."""
    xs, ys = [], []
    for row in scenario_rows(results):
        if row["mode"] != "chunked" or row["b_ttft_ms"] is None:
            continue
        length, size = int(row["b_len"]), int(row["chunk_size"])
        starts = range(0, length, size)
        pieces = [min(size, length - s) for s in starts]
        steps = len(pieces) * step_ms
        xs.append([len(pieces), length, sum(c * (s + c / 2) for s, c in zip(starts, pieces, strict=True))])
        ys.append(row["b_ttft_ms"] - steps)
    return least_squares("chunk (k0 + k1*c + k2*c*(P+c/2))", np.array(xs), np.array(ys))


def later_turn_rows(results: Path) -> list[dict[str, Any]]:
    """The later turns of the newest run of the recorded shape that timed them: the later-turn file, else
    bench.micro.engine_steps's history. Taken whatever else the run's engine did (overlapped steps among it): a turn
    alone runs no decode step, and one beside a batch is compared with that run's own steps."""
    path = results / LATER_TURNS
    run: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
    runs = [run] if run is not None else []
    run = load_result("engine-h200.json", results)
    while run is not None:
        runs.append(run)
        run = run.get("previous")
    for run in runs:
        rows = run.get("later_turns", [])
        if any(not r.get("batch") for r in rows) and run.get("preset", PRESET) == PRESET:
            return list(rows)
    return []


def fit_later_turn(rows: list[dict[str, Any]]) -> Fit | None:
    """A prefill of c tokens after P cached ones, over the turns alone (batch 0): a fixed part, the new tokens'
    own work, the prefix's K and V read from the pool (every layer), and the new tokens' attention over the prefix
    and each other; fitted to the relative errors (a 64-token turn's 5 ms counts as much as a 2k one's). None
    without enough rows to fix four terms (two prefix and two new lengths, five rows at least)."""
    rows = [r for r in rows if not r.get("batch") and not r.get("sms")]  # alone, on every SM
    x = np.array([[1.0, r["new"], r["prefix"], r["new"] * (r["prefix"] + r["new"] / 2)] for r in rows])
    if len(rows) < 5 or np.linalg.matrix_rank(x) < 4:
        return None
    y = np.array([float(r["ms"]) for r in rows])
    keep = list(range(x.shape[1]))
    while True:  # no term may cost less than nothing: a negative one is dropped and the rest refitted
        fit = least_squares("later turn (f0+f1*c+f2*P+f3*c*(P+c/2))", x[:, keep] / y[:, None], np.ones(len(rows)))
        negative = [i for i, p in zip(keep, fit.params, strict=True) if p < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(min(negative, key=lambda i: fit.params[keep.index(i)]))
    params = np.zeros(x.shape[1])
    params[keep] = fit.params
    fit = Fit(fit.name, tuple(float(p) for p in params), fit.r2, fit.max_rel_error, fit.points)
    return _requality(fit, x, y, offset=np.zeros(len(rows)))


def fit_later_turn_beside(rows: list[dict[str, Any]]) -> list[Fit]:
    """For each batch the turns ran beside: the running sequences' gap across the turn less its step and the turn
    alone (a constant, its quality on the gaps). What the simulator's sequential prefill-then-step leaves out;
    printed, not charged."""
    alone = {(r["prefix"], r["new"]): float(r["ms"]) for r in rows if not r.get("batch")}
    fits = []
    for batch in sorted({int(r["batch"]) for r in rows if r.get("batch")}):
        beside = [r for r in rows if r.get("batch") == batch and r.get("gap_ms") and r.get("step_ms")
                  and (r["prefix"], r["new"]) in alone]
        if len(beside) < 3:
            continue
        known = np.array([alone[r["prefix"], r["new"]] + r["step_ms"] for r in beside])
        x, y = np.ones((len(beside), 1)), np.array([r["gap_ms"] for r in beside]) - known
        fits.append(_requality(least_squares(f"later turn beside batch {batch} (gap-step-alone)", x, y), x, y, known))
    return fits


def fit_layered(results: Path, prefill: Fit) -> Fit:
    """From the scenario: layered B's TTFT = its whole prefill + (decode step + l0) a slice."""
    p0, p1, p2 = prefill.params
    xs, known, whole = [], [], []
    for row in scenario_rows(results):
        if row["mode"] != "layered" or row["b_ttft_ms"] is None:
            continue
        t = int(row["b_len"])
        slices = layered_slices(t)
        xs.append([slices])
        known.append(p0 + p1 * t + p2 * t * t + slices * float(row["a_median_gap_ms"]))
        whole.append(row["b_ttft_ms"])
    x, offset = np.array(xs, dtype=float), np.array(known)
    y = np.array(whole) - offset
    return _requality(least_squares("layered slice overhead (l0)", x, y), x, y, offset)


def fit_local_factor(results: Path, prefill: Fit) -> Fit:
    """From the scenario: colocated B's TTFT against the engine's prefill of its prompt, as a factor. The 4k-32k
    rows sit within -1% to +2% of the engine's, a spread in proportion to the prefill; a constant fitted to them
    (+4.4 ms, -7.4 ms a fit before) is that spread's mean at 32k, and charged on a 150-token turn it was most
    of the turn. The server's own fixed costs a call are `Serving.local_call_ms`, calibrated on a load run."""
    p0, p1, p2 = prefill.params
    whole, engine = [], []
    for row in scenario_rows(results):
        if row["mode"] == "colocated" and row["b_ttft_ms"] is not None:
            t = int(row["b_len"])
            whole.append(row["b_ttft_ms"])
            engine.append(p0 + p1 * t + p2 * t * t)
    x, y = np.array(engine).reshape(-1, 1), np.array(whole)
    return least_squares("local prefill against the engine's (factor)", x, y)


def fit_partition() -> Fit:
    """Linear in the prefill's SMs, fitted jointly to the decode slowdowns and the prefill rate shares."""
    sms = sorted(PARTITION_LAB)
    slow = np.array([PARTITION_LAB[s][0] / PARTITION_ALONE_STEP_MS for s in sms])
    rate = np.array([PARTITION_LAB[s][1] for s in sms])
    zeros = np.zeros((len(sms), 2))
    block = np.array([[1.0, s] for s in sms])
    x = np.vstack([np.hstack([block, zeros]), np.hstack([zeros, block])])
    return least_squares("partition (slowdown, rate) ~ SMs", x, np.concatenate([slow, rate]))


def fit_kv(results: Path, transport: str) -> tuple[Fit, float, float]:
    rows = load_result("kv_transfer-2xh200.json", results)["rows"]
    ends = [r for r in rows if r["transport"] == transport and r["mode"] == "endpoints"
            and r.get("blocks", "contiguous") == "contiguous"]
    if not ends:
        raise ValueError(f"no endpoint rows for transport {transport!r} in kv_transfer-2xh200.json")
    x = np.array([[r["seconds"] / (r["bytes"] / 1e9)] for r in ends])  # fit 1 / GB/s as a constant
    seconds_per_gb = least_squares("kv", np.ones((len(ends), 1)), x[:, 0])
    gbps = 1.0 / seconds_per_gb.params[0]
    times = np.array([r["seconds"] for r in ends])
    predicted = np.array([r["bytes"] / 1e9 / gbps for r in ends])
    fit = Fit(f"KV handoff {transport} (GB/s)", (gbps,), seconds_per_gb.r2,
              float(np.max(np.abs(predicted - times) / times)), len(ends))
    servers = [r for r in rows if r["transport"] == transport and r["mode"] == "servers"]
    tail_ms = float(np.median([r["seconds"] for r in servers])) * 1e3 if servers else float(np.median(times)) * 1e3
    # what of that tail is exposed after the prefill's last layer (the prefill worker's last sends, and the decode
    # side's completion after the result): the most the prefill worker can wait for its sends
    exposed = [r["exposed_ms"] for r in servers if r.get("exposed_ms") is not None]
    send_ms = float(np.median(exposed)) if exposed else tail_ms
    return fit, tail_ms, send_ms


def fit_costs(results: Path = RESULTS, transport: str = "nccl") -> Costs:
    engine = profiled_engine(results)
    hbm = float(engine["hbm_gbps_measured"])
    attention, alone = fit_attention(results), fit_attention_alone(results)
    long_history = fit_long_history(results, attention)
    model = attention_model_of(attention, hbm, alone, long_history)
    prefill, decode = fit_prefill(results), fit_decode(results, model)
    a_step_ms = decode.params[0] + decode.params[1] + model.step_ms(1, ENGINE_CONTEXT, ENGINE_CONTEXT)
    kv, tail, send = fit_kv(results, transport)
    turns = later_turn_rows(results)
    return Costs(attention=attention, decode=decode, prefill=prefill, chunk=fit_chunk(results, a_step_ms),
                 layered=fit_layered(results, prefill), local_factor=fit_local_factor(results, prefill),
                 partition=fit_partition(), kv=kv, kv_tail_ms=tail, hbm_gbps=hbm, kv_send_ms=send,
                 later_turn=fit_later_turn(turns), later_turn_beside=tuple(fit_later_turn_beside(turns)),
                 attention_alone=alone, long_history=long_history)


def describe(costs: Costs) -> Sequence[str]:
    handoff = (f"KV handoff beyond the prefill: {costs.kv_tail_ms:.2f} ms at 32k (servers' median), of which the "
               f"prefill worker waits {costs.kv_send_ms:.2f} ms for its sends (median exposed)")
    later = ([] if costs.later_turn is not None else
             [f"later turns (a prefill after a cached prefix): priced as one chunk, no {PRESET} later_turns rows in "
              f"{LATER_TURNS} or engine-h200.json (python -m bench.micro.engine_steps --later-turns)"])
    return [*(f.line() for f in costs.fits()), handoff, *later]


def costs_record(costs: Costs) -> dict[str, Any]:
    """The fits as `python -m planner --costs` records them: each with its Costs field, name, parameters and
    quality; the KV handoff's tail; the lab's partition figures."""
    fits = []
    for field in fields(costs):  # every Fit the simulator holds, alone or in a tuple
        value = getattr(costs, field.name)
        fits += [{"field": field.name, **asdict(fit)} for fit in (value if isinstance(value, tuple) else (value,))
                 if isinstance(fit, Fit)]
    return {"fits": fits, "kv_tail_ms": costs.kv_tail_ms, "kv_send_ms": costs.kv_send_ms,
            "partition_alone_step_ms": PARTITION_ALONE_STEP_MS,
            "partition_lab": {str(sms): list(figures) for sms, figures in sorted(PARTITION_LAB.items())}}
