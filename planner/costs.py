"""Per-operation costs for the cluster simulator (`Costs`), and the recorded measurements in bench/results
they are fitted to (planner.fits).

Every fit keeps its quality (R^2 and the largest relative error over the points it was fitted to),
so `python -m planner` can print how far each cost can be trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from planner.attention_cost import AttentionModel

RESULTS = Path(__file__).parent.parent / "bench" / "results"
LAYERS = 28                      # Qwen2.5-7B, the preset every recorded run used
KV_BYTES_PER_TOKEN = 57_344      # 28 layers x K and V x 4 KV heads x 128 x 2 bytes
# Lab figures on one H200 (prefill matmuls confined to a share of the SMs beside decode steps):
# SMs given to the prefill -> (decode step beside it, ms; prefill matmul rate as a share of the whole GPU's).
PARTITION_ALONE_STEP_MS = 3.71
PARTITION_LAB = {100: (10.7, 0.77), 84: (7.5, 0.65), 68: (5.9, 0.55)}
PRESET = "qwen2.5-7b"  # the shape every recorded run served
LATER_TURNS = "engine-later-turns-h200.json"  # `bench.micro.engine_steps --later-turns` on one H200
GRAPHED_TOKENS = 512  # engine.prefill_graphs.BUCKETS[-1]: the engine thread's prefills of up to this many replay graphs
PARTITION_GRAPHED_TOKENS = 384  # engine.prefill_graphs.PARTITION_BUCKETS[-1]: the partitioned thread's
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


def load_result(name: str, results: Path) -> dict[str, Any]:
    path = results / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the simulator's costs are fitted to it; restore bench/results")
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def engine_runs(results: Path) -> Iterator[dict[str, Any]]:
    """Every recorded bench.micro.engine_steps run on one H200 of the engine the recorded load runs were served by (its
    history, and each card of the two-GPU machine). Runs with `overlap_steps` time a later engine (overlapped
    steps, other kernels and attention splits) that served none of them, so the simulator leaves them out."""
    run: dict[str, Any] | None = load_result("engine-h200.json", results)
    while run is not None:
        if not run.get("overlap_steps"):
            yield run
        run = run.get("previous")
    yield from load_result("engine-2xh200.json", results)["runs"]


def profiled_engine(results: Path = RESULTS) -> dict[str, Any]:
    """The newest of those runs with a kernel profile (`bench.micro.engine_steps --profile`)."""
    return next(run for run in engine_runs(results) if "decode_profile" in run)


def scenario_rows(results: Path) -> Iterator[dict[str, Any]]:
    for name in ("scenario-h200.json", "scenario-2xh200.json", "scenario-layered-2xh200.json"):
        yield from load_result(name, results)["rows"]


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
    local_factor: Fit  # a local prefill in the server against the engine's: a factor
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
                self.prefill, self.chunk, self.layered, self.local_factor, self.partition, self.kv,
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
        return self.prefill_ms(tokens, cached) * self.local_factor.params[0]

    def chunk_ms(self, tokens: int, prefix: int) -> float:
        k0, k1, k2 = self.chunk.params
        return k0 + k1 * tokens + k2 * tokens * (prefix + tokens / 2)

    def later_turn_ms(self, tokens: int, cached: int) -> float:
        """The engine's prefill of `tokens` after `cached` tokens from the prefix cache: the later-turn fit, or
        one chunk where no run timed later turns. A turn of up to GRAPHED_TOKENS replays the prefill graphs, as
        the timed ones (64-400 tokens) did; a longer one runs eagerly, so costs at least what a chunk of it
        does (the chunk fit's eager chunks)."""
        chunk = self.chunk_ms(tokens, cached)
        if self.later_turn is None:
            return chunk
        fit = self._later_turn_fit_ms(tokens, cached)
        return fit if tokens <= GRAPHED_TOKENS else max(chunk, fit)

    def _later_turn_fit_ms(self, tokens: int, cached: int) -> float:
        assert self.later_turn is not None
        f0, f1, f2, f3 = self.later_turn.params
        return f0 + f1 * tokens + f2 * cached + f3 * tokens * (cached + tokens / 2)

    def prefill_on_share_ms(self, tokens: int, cached: int, rate: float) -> float:
        """The engine's prefill on a share of the SMs that runs it at `rate` of the whole GPU's pace (partitioned).
        A later turn of up to PARTITION_GRAPHED_TOKENS replays the prefill thread's own graphs: the later-turn fit (the
        engine thread's graphed turns) with its terms in the tokens slowed by the share and its fixed part
        (the host's) not; within 9% of the turns timed on 72 SMs of one H200, where the whole fit over the
        share was up to 40% over (bench/NOTES.md). A longer one runs eagerly: a chunk of it on the share,
        held at least at the fit."""
        if cached > 0 and self.later_turn is not None and tokens > 0:
            fit = self._later_turn_fit_ms(tokens, cached)
            if tokens <= PARTITION_GRAPHED_TOKENS:
                fixed = self.later_turn.params[0]
                return fixed + (fit - fixed) / rate
            return max(self.chunk_ms(tokens, cached) / rate, fit)
        return self.prefill_ms(tokens, cached) / rate

    def local_prefill_on_share_ms(self, tokens: int, cached: int, rate: float) -> float:
        """`prefill_on_share_ms` in the server: times the server's factor over the engine, as `local_prefill_ms`."""
        return self.prefill_on_share_ms(tokens, cached, rate) * self.local_factor.params[0]

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
