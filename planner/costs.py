"""Per-operation costs for the cluster simulator, each fitted to the recorded measurements in bench/results.

Every fit keeps its quality (R^2 and the largest relative error over the points it was fitted to),
so `python -m planner` can print how far each cost can be trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from planner.attention_cost import ENGINE_CONTEXT, AttentionModel, alone_points, attention_points, longest_program_bytes

RESULTS = Path(__file__).parent.parent / "bench" / "results"
LAYERS = 28                      # Qwen2.5-7B, the preset every recorded run used
KV_BYTES_PER_TOKEN = 57_344      # 28 layers x K and V x 4 KV heads x 128 x 2 bytes
# Lab figures on one H200 (prefill matmuls confined to a share of the SMs beside decode steps):
# SMs given to the prefill -> (decode step beside it, ms; prefill matmul rate as a share of the whole GPU's).
PARTITION_ALONE_STEP_MS = 3.71
PARTITION_LAB = {100: (10.7, 0.77), 84: (7.5, 0.65), 68: (5.9, 0.55)}
PRESET = "qwen2.5-7b"  # the shape every recorded run served
LATER_TURNS = "engine-later-turns-h200.json"  # `bench.micro.engine_steps --later-turns` on one H200
ATTENTION_SWEEPS = "decode-attention*.json"   # `bench.micro.decode_attention` on one H200, each split count timed
LONG_HISTORY = "attention-long-history*.json"  # the same with --long-context: one long history among short ones


@dataclass(frozen=True)
class Fit:
    """A least-squares fit y ~ X @ params, with its quality over the points it was fitted to (R^2 is nan for
    a constant, which explains none of the spread by definition; its max relative error still says how good it is)."""

    name: str
    params: tuple[float, ...]
    r2: float
    max_rel_error: float
    points: int

    def line(self) -> str:
        values = ", ".join(f"{p:.4g}" for p in self.params)
        quality = f"R^2 {self.r2:7.4f}  max rel err {self.max_rel_error:6.1%}"
        return f"{self.name:<34} {self.points:>3} pts  {quality}  [{values}]"


def least_squares(name: str, x: np.ndarray, y: np.ndarray) -> Fit:
    """Fit y ~ x @ p; R^2 is computed against y's mean (1 - SS_res / SS_tot)."""
    params, *_ = np.linalg.lstsq(x, y, rcond=None)
    predicted = x @ params
    ss_tot = float(((y - y.mean()) ** 2).sum())
    constant = x.shape[1] == 1 and bool(np.all(x == x[0]))
    r2 = math.nan if constant or ss_tot == 0 else 1.0 - float(((y - predicted) ** 2).sum()) / ss_tot
    rel = float(np.max(np.abs(predicted - y) / np.abs(y)))
    return Fit(name, tuple(float(p) for p in params), r2, rel, len(y))


def _load(name: str, results: Path) -> dict[str, Any]:
    path = results / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the simulator's costs are fitted to it; restore bench/results")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _engine_runs(results: Path) -> Iterator[dict[str, Any]]:
    """Every recorded bench.micro.engine_steps run on one H200 of the engine the recorded load runs were served by (its
    history, and each card of the two-GPU machine). Runs with `overlap_steps` time a later engine (overlapped
    steps, other kernels and attention splits) that served none of them, so the simulator leaves them out."""
    run: dict[str, Any] | None = _load("engine-h200.json", results)
    while run is not None:
        if not run.get("overlap_steps"):
            yield run
        run = run.get("previous")
    yield from _load("engine-2xh200.json", results)["runs"]


def profiled_engine(results: Path = RESULTS) -> dict[str, Any]:
    """The newest of those runs with a kernel profile (`bench.micro.engine_steps --profile`)."""
    return next(run for run in _engine_runs(results) if "decode_profile" in run)


def _scenario_rows(results: Path) -> Iterator[dict[str, Any]]:
    for name in ("scenario-h200.json", "scenario-2xh200.json", "scenario-layered-2xh200.json"):
        yield from _load(name, results)["rows"]


def layered_slices(tokens: int, slice_tokens: int = 32_768) -> int:
    """How many engine steps a layered prefill takes: as many layers a slice as keep tokens x layers <= slice_tokens."""
    per_slice = max(1, slice_tokens // max(1, tokens))
    return math.ceil(LAYERS / per_slice)


@dataclass(frozen=True)
class Costs:
    """Every duration the simulator charges, in milliseconds."""

    attention: Fit     # the split kernel, a layer: a0 us + the longest program's bytes * a1 us/byte
    decode: Fit        # step - attention = d0 + d1 * batch
    prefill: Fit       # whole prompt: p0 + p1 * T + p2 * T^2
    chunk: Fit         # one chunk of c tokens after P cached/prefilled ones: k0 + k1 * c + k2 * c * (P + c / 2)
    layered: Fit       # a layered prefill: the whole prefill + l0 per slice
    local_extra: Fit   # a local whole-prompt prefill in the server beyond the engine's: constant
    partition: Fit     # decode slowdown and prefill rate against the SMs given to the prefill (linear)
    kv: Fit            # the handoff's bytes / bandwidth, from the endpoint rows: constant GB/s
    kv_tail_ms: float  # the handoff beyond the prefill in the servers (control messages, last layer), at 32k
    hbm_gbps: float
    kv_send_ms: float = 0.0  # of that tail, what the prefill worker waits for (its last sends) before the next prompt
    # a prefill of c tokens after P cached ones (bench.micro.engine_steps --later-turns):
    # f0 + f1*c + f2*P + f3*c*(P + c/2);
    # None where no run timed later turns: such a prefill is then priced as one chunk
    later_turn: Fit | None = None
    later_turn_beside: tuple[Fit, ...] = ()  # the same turns beside decode batches: their excess, printed only
    # the split kernel's program alone on its SM (bench.micro.decode_attention): b0 + b1 * bytes; its rate 1/b1
    # prices the part of the longest program read after the batch's other programs are done.
    # None: all at the shared rate
    attention_alone: Fit | None = None
    # the rest of a long history's program in a batch of short ones (bench.micro.decode_attention --long-context),
    # at the split counts the kernel picks: b1 * bytes. Where it was measured its rate prices that part, not the
    # lone one's
    long_history: Fit | None = None

    def fits(self) -> list[Fit]:
        return [self.attention, *[f for f in (self.attention_alone, self.long_history) if f is not None], self.decode,
                self.prefill, self.chunk, self.layered, self.local_extra, self.partition, self.kv,
                *([self.later_turn] if self.later_turn is not None else []), *self.later_turn_beside]

    @cached_property
    def attention_model(self) -> AttentionModel:  # built once: every simulated decode step prices with it
        return attention_model_of(self.attention, self.hbm_gbps, self.attention_alone, self.long_history)

    def decode_ms(self, batch: int, context_tokens: float, longest: int, slowdown: float = 1.0) -> float:
        """One decode step of `batch` sequences holding `context_tokens` in all, the longest `longest`.

        `slowdown` (a prefill beside the step on a share of the SMs) stretches the weight reads, which it
        was measured on; the attention's longest program is bound by its own memory latency on one SM and
        is left as it is."""
        d0, d1 = self.decode.params
        return slowdown * (d0 + d1 * batch) + self.attention_model.step_ms(batch, longest, context_tokens)

    def prefill_ms(self, tokens: int, cached: int = 0) -> float:
        """The engine's prefill of `tokens` new tokens, after `cached` ones from the prefix cache (a later turn)."""
        if tokens <= 0:
            return 0.0
        if cached > 0:
            return self.later_turn_ms(tokens, cached)
        p0, p1, p2 = self.prefill.params
        return p0 + p1 * tokens + p2 * tokens * tokens

    def local_prefill_ms(self, tokens: int, cached: int = 0) -> float:
        return self.prefill_ms(tokens, cached) + self.local_extra.params[0]

    def chunk_ms(self, tokens: int, prefix: int) -> float:
        k0, k1, k2 = self.chunk.params
        return k0 + k1 * tokens + k2 * tokens * (prefix + tokens / 2)

    def later_turn_ms(self, tokens: int, cached: int) -> float:
        """The engine's prefill of `tokens` after `cached` tokens from the prefix cache: the later-turn fit, or
        one chunk where no run timed later turns. The timed turns (64-400 tokens) are bound by the host's
        launches, not the GPU, so a longer turn costs at least what the GPU takes for it as a chunk."""
        chunk = self.chunk_ms(tokens, cached)
        if self.later_turn is None:
            return chunk
        return max(chunk, self._later_turn_fit_ms(tokens, cached))

    def _later_turn_fit_ms(self, tokens: int, cached: int) -> float:
        assert self.later_turn is not None
        f0, f1, f2, f3 = self.later_turn.params
        return f0 + f1 * tokens + f2 * cached + f3 * tokens * (cached + tokens / 2)

    def prefill_on_share_ms(self, tokens: int, cached: int, rate: float) -> float:
        """The engine's prefill on a share of the SMs that runs it at `rate` of the whole GPU's pace (partitioned).
        The GPU's work slows by the share; a later turn's launch-bound floor (the later-turn fit: the host's
        kernel launches, whatever the SMs) does not."""
        if cached > 0 and self.later_turn is not None and tokens > 0:
            return max(self.chunk_ms(tokens, cached) / rate, self._later_turn_fit_ms(tokens, cached))
        return self.prefill_ms(tokens, cached) / rate

    def chunk_piece_ms(self, tokens: int, done: int, cached: int) -> float:
        """A chunked prefill's next chunk of `tokens` after `done` tokens, `cached` of them from the prefix cache.
        The first chunk after a hit is the engine call a colocated later turn makes, priced as one where later
        turns were timed; every other chunk by the chunk fit."""
        if self.later_turn is not None and done == cached > 0:
            return self.local_prefill_ms(tokens, cached)
        return self.chunk_ms(tokens, done)

    def layer_slice_ms(self, tokens: int, cached: int, slices: int) -> float:
        return self.prefill_ms(tokens, cached) / slices + self.layered.params[0]

    def partition_factors(self, sms: int) -> tuple[float, float]:
        """(decode step slowdown, prefill rate share) with `sms` SMs confined to the prefill."""
        s0, s1, r0, r1 = self.partition.params
        return s0 + s1 * sms, r0 + r1 * sms

    def kv_handoff_ms(self, tokens: int) -> float:
        """The handoff beyond the prefill: the servers' measured tail at 32k, less the bytes a shorter prompt
        does not move (layers stream out while later ones compute, so one layer's share of the bytes is exposed)."""
        gbps = self.kv.params[0]
        per_layer_ms = tokens * KV_BYTES_PER_TOKEN / LAYERS / (gbps * 1e9) * 1e3
        full_layer_ms = 32_768 * KV_BYTES_PER_TOKEN / LAYERS / (gbps * 1e9) * 1e3
        return max(0.0, self.kv_tail_ms - full_layer_ms) + per_layer_ms

    def prefill_server_hold_ms(self, tokens: int) -> float:
        """How long a prefill server stays with a prompt after its compute: `sender.finish()`, its last sends. The
        rest of the handoff (the decode side's receive completing, the result message) happens on the decode
        server while the prefill server computes its next prompt."""
        return min(self.kv_send_ms, self.kv_handoff_ms(tokens))


def attention_model_of(fit: Fit, hbm_gbps: float, alone: Fit | None = None,
                       long_history: Fit | None = None) -> AttentionModel:
    """The split kernel's model from its fit: a0 µs a layer, a1 µs a byte of the longest program (its rate 1/a1).
    The rest of the longest program, once the batch's others are done, reads at the long-history rows' rate where
    they exist, else at a program's rate alone on its SM, 1/b1 (its b0, the launch of a grid of a few programs, is
    the profile's a0 in the model)."""
    launch_us, us_per_byte = fit.params
    alone_gbps = None
    if long_history is not None:
        alone_gbps = 1.0 / (long_history.params[0] * 1e3)
    elif alone is not None:
        alone_gbps = 1.0 / (alone.params[1] * 1e3)
    return AttentionModel(launch_us, 1.0 / (us_per_byte * 1e3), hbm_gbps, alone_gbps)


def fit_attention(results: Path) -> Fit:
    """The split kernel's time a layer against its longest program's bytes (bench.micro.engine_steps's profile)."""
    x, y = attention_points(profiled_engine(results))
    return least_squares("decode attention a layer (a0 + a1*bytes)", x, y)


def attention_sweep_rows(results: Path) -> list[dict[str, Any]]:
    """Every `bench.micro.decode_attention` file's rows of equal contexts, a shape (context, batch, splits) measured
    again in a later file replacing the earlier row (decode-attention-b1-h200.json: batch 1 re-read from HBM
    where the first sweep's layers fit in L2)."""
    docs = [json.loads(path.read_text()) for path in results.glob(ATTENTION_SWEEPS)]
    docs.sort(key=lambda doc: doc.get("date", ""))
    rows = {(r["context"], r["batch"], r["splits"]): r for doc in docs for r in doc["rows"] if "long_context" not in r}
    return list(rows.values())


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
            for run in _engine_runs(results) for b, ms in run["decode_ms"].items()]
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
    rows = [(int(t), ms) for run in _engine_runs(results) for t, ms in run.get("prefill_ms", {}).items()]
    x = np.array([[1.0, t, t * t] for t, _ in rows])
    return least_squares("prefill (p0 + p1*T + p2*T^2)", x, np.array([ms for _, ms in rows]))


def fit_chunk(results: Path, step_ms: float) -> Fit:
    """From the scenario: B's TTFT with chunks of c = its chunks plus A's one-sequence decode step after each."""
    xs, ys = [], []
    for row in _scenario_rows(results):
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
    run = _load("engine-h200.json", results)
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
    for row in _scenario_rows(results):
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


def fit_local_extra(results: Path, prefill: Fit) -> Fit:
    """From the scenario: colocated B's TTFT beyond the engine's prefill of its prompt (request set-up, first read)."""
    p0, p1, p2 = prefill.params
    whole, engine = [], []
    for row in _scenario_rows(results):
        if row["mode"] == "colocated" and row["b_ttft_ms"] is not None:
            t = int(row["b_len"])
            whole.append(row["b_ttft_ms"])
            engine.append(p0 + p1 * t + p2 * t * t)
    x, y = np.ones((len(whole), 1)), np.array(whole) - np.array(engine)
    return _requality(least_squares("local prefill extra (constant)", x, y), x, y, np.array(engine))


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
    rows = _load("kv_transfer-2xh200.json", results)["rows"]
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
                 layered=fit_layered(results, prefill), local_extra=fit_local_extra(results, prefill),
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
