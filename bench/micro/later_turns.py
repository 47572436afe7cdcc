"""A chat's later turn on the engine (`python -m bench.micro.engine_steps --later-turns`): the prefill of `new`
tokens after a `prefix` of cached tokens, as the servers run it on a prefix-cache hit.

Each prefix is prefilled once as a first turn and published to a `PrefixCache` over the runner's
pool, as the decode server publishes a finished prompt. A later turn is that prefix and `new`
random tokens: `PrefixCache.acquire` gives its block table with the prefix's blocks in it, and the
timed span is the one the servers record as the prompt's prefill (`prefill_s`): `runner.prefill`
of the uncached tokens from the cached length on, then the first token sampled and read back
(`LocalPrefill._first_token`, the prefill worker's read). Its private blocks go back after each
turn, the prefix stays cached.

Beside a decode batch (`batch` > 0): `batch` sequences of `context` tokens decode as the colocated
server runs them (each step queued before the last one's tokens are read back, unless the steps
are not overlapped), and the turn's prefill runs between two steps, as one iteration of
`BatchScheduler.step` runs a local prefill and then the decode step. Its span then includes
waiting for the step queued before it; the running sequences' longest gap between token
read-backs over the turn's iteration and the next is `gap_ms`, beside `step_ms`, the median gap of
the plain iterations before it.

With `profile`, one more turn a row runs under `cProfile`: the host's share of a turn (the time until
`runner.prefill` has queued its kernels), its Triton launches and its costliest Python functions,
since a turn that runs eagerly (past the prefill graphs' largest bucket) can take the host longer than
the GPU. The profiler's own cost inflates Python's share, so those figures rank, they do not time.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.micro.decode_loop import DecodeLoop, sync
from engine.green_context import SmPartitions, Unconfined
from engine.host_read import TokenReader
from engine.prefill_graphs import PrefillGraphs
from engine.prefix_cache import PrefixCache
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample

PLAIN_STEPS = 3   # plain iterations before each turn beside a batch: `step_ms`
AFTER_STEPS = 2   # iterations from the turn's on, whose gaps give `gap_ms`
BATCH_SEEDS, TURN_SEEDS = 1 << 40, 1 << 41  # random tokens' seeds: a prefix's is its length
COSTLIEST = 8  # functions a profiled turn records, by their own time


def batch_steps(rows: int, repeats: int) -> int:
    """Decode steps a running batch takes over `rows` rows of `repeats` timed turns and an untimed one."""
    return rows * (repeats + 1) * (PLAIN_STEPS + AFTER_STEPS)


def random_tokens(runner: ModelRunner, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, runner.config.vocab_size, (n,), generator=gen).tolist()


class RunningBatch:
    """`batch` sequences with `context` prefilled tokens each, decoding one step a call as the decode
    server's `_decode_step` does; their blocks come from the cache's allocator and go back on `close`."""

    def __init__(self, runner: ModelRunner, cache: PrefixCache, batch: int, context: int, steps: int,
                 overlap: bool) -> None:
        self.runner, self.cache, self.overlap = runner, cache, overlap
        self.tables = [cache.allocate(runner.pool.blocks_needed(context + steps + 2)) for _ in range(batch)]
        for i, table in enumerate(self.tables):
            runner.prefill(random_tokens(runner, context, seed=BATCH_SEEDS + i), table, 0)
        self.loop = DecodeLoop(runner, self.tables, context, overlap)
        self.steps_left = steps
        self.read_at: float | None = None  # when the last step's tokens were read back
        sync(runner)

    def step(self) -> float | None:
        """One decode step: queued, then the step before it read back (overlapped), or queued and read.
        Returns the gap since the tokens before were read back, ms (None at the first read)."""
        if self.steps_left <= 0:
            raise ValueError("the running batch's block tables are full: give it more steps")
        self.steps_left -= 1
        if not self.loop.step():
            return None
        now = time.perf_counter()
        gap = None if self.read_at is None else (now - self.read_at) * 1e3
        self.read_at = now
        return gap

    def close(self) -> None:
        sync(self.runner)
        for table in self.tables:
            self.cache.release(table)


class LaterTurns:
    """Cached first turns of each prefix length, and the timed later turns after them."""

    def __init__(self, runner: ModelRunner, partitions: SmPartitions | None = None, sms: int = 0) -> None:
        """With `sms`, each timed turn runs confined to that many SMs, as partitioned mode's prefill thread
        runs it (`partitions.confine`), replaying that share's own prefill graphs as that thread does
        (`ModelRunner.partition_graphs`; eagerly where the partitions have no streams of their own)."""
        self.runner = runner
        self.partitions, self.sms = partitions or Unconfined(), sms
        self.cache = PrefixCache(runner.pool.allocator, runner.pool.layout.block_size)
        self.reader = TokenReader(runner.device, 1)
        self.prefixes: dict[int, list[int]] = {}
        self.turns = 0  # seeds each turn's new tokens: no turn finds another's in the cache
        self.queued_ms = 0.0  # the last turn's host time until its prefill's kernels were queued
        self.partition_graphs: PrefillGraphs | None = None  # the share's own set, captured at its first turn

    def first_turn(self, prefix: int) -> None:
        """Prefill `prefix` tokens and publish them, as the decode server does with a finished prompt."""
        block = self.cache.block_size
        if prefix <= 0 or prefix % block:
            raise ValueError(f"a prefix of {prefix} tokens: the cache holds whole blocks of {block} tokens")
        tokens = random_tokens(self.runner, prefix, seed=prefix)
        table, cached = self.cache.acquire(tokens, self.runner.pool.blocks_needed(prefix))
        try:
            self.runner.prefill(tokens[cached:], table, cached)
            self.cache.publish(tokens, table, prefix)
        finally:
            sync(self.runner)
            self.cache.release(table)
        self.prefixes[prefix] = tokens

    def _graphs(self) -> bool | PrefillGraphs:
        """What a turn replays: the engine thread's graphs, or inside a partition that partition's own."""
        if not self.sms:
            return True
        if self.partitions.streams_of_their_own:
            self.partition_graphs = self.runner.partition_graphs()
        return self.partition_graphs if self.partition_graphs is not None else False

    def turn_ms(self, prefix: int, new: int, batch: RunningBatch | None = None,
                profiler: cProfile.Profile | None = None) -> tuple[float, float | None]:
        """One later turn (ms, as the servers time its prefill) and, beside a batch, the batch's longest
        token gap from the turn's iteration on (ms). `profiler` runs while the prefill is queued."""
        self.turns += 1
        prompt = self.prefixes[prefix] + random_tokens(self.runner, new, seed=TURN_SEEDS + self.turns)
        table, cached = self.cache.acquire(prompt, self.runner.pool.blocks_needed(len(prompt) + 1))
        try:
            if cached != prefix:
                raise RuntimeError(f"the cache gave {cached} of the {prefix} prefix tokens: the KV pool is too "
                                   "small for the prefixes and the running batch")
            with self.partitions.confine(self.sms) if self.sms else contextlib.nullcontext():
                t0 = time.perf_counter()
                with profiler if profiler is not None else contextlib.nullcontext():
                    logits = self.runner.prefill(prompt[cached:], table, cached, graphed=self._graphs())
                self.queued_ms = (time.perf_counter() - t0) * 1e3
                self.reader.read(sample(logits[None], [SamplingParams()], [0]))  # waits for the prefill's kernels
                ms = (time.perf_counter() - t0) * 1e3
        except BaseException:
            sync(self.runner)
            raise
        finally:
            self.cache.release(table)
        gaps = [batch.step() for _ in range(AFTER_STEPS)] if batch is not None else []
        return ms, max((g for g in gaps if g is not None), default=None)


def host_profile(turns: LaterTurns, prefix: int, new: int) -> dict[str, Any]:
    """One more turn under `cProfile`: its time, the host's time until its kernels were queued, its Triton
    launches (`JITFunction.run` calls) and the COSTLIEST functions by their own time."""
    profiler = cProfile.Profile()
    ms, _ = turns.turn_ms(prefix, new, profiler=profiler)
    entries = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
    launches = sum(calls for (file, _, name), (_, calls, *_) in entries.items()
                   if name == "run" and Path(file).as_posix().endswith("triton/runtime/jit.py"))
    costliest = sorted(entries.items(), key=lambda e: e[1][2], reverse=True)[:COSTLIEST]
    return {"ms": round(ms, 3), "queued_ms": round(turns.queued_ms, 3), "triton_launches": launches,
            "costliest": [{"function": f"{Path(file).name}:{line}({name})", "calls": calls,
                           "self_ms": round(own * 1e3, 3)}
                          for (file, line, name), (_, calls, own, *_) in costliest]}


def measure(runner: ModelRunner, prefixes: Sequence[int], news: Sequence[int], batches: Sequence[int],
            context: int, repeats: int, overlap: bool = True, partitions: SmPartitions | None = None,
            sms: int = 0, profile: bool = False) -> list[dict[str, Any]]:
    """A row for every batch (0: the turn alone), prefix and new length: the median of `repeats` timed
    turns after an untimed one (`ms`, and the fastest, `min_ms`); beside a batch its gaps too. With
    `sms` the turns run on that many SMs (alone only: partitioned mode decodes on another thread);
    with `profile`, each row's `host_profile` under `host`."""
    if sms and any(batches):
        raise ValueError("turns confined to a share of the SMs are timed alone: --later-turn-batches 0")
    turns = LaterTurns(runner, partitions, sms)
    for prefix in prefixes:
        turns.first_turn(prefix)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        steps = batch_steps(len(prefixes) * len(news), repeats)
        running = RunningBatch(runner, turns.cache, batch, context, steps, overlap) if batch else None
        try:
            for prefix in prefixes:
                for new in news:
                    rows.append(_row(turns, prefix, new, batch, context, repeats, running))
                    if sms:
                        rows[-1]["sms"] = sms
                    if profile:
                        rows[-1]["host"] = host_profile(turns, prefix, new)
                    print_row(rows[-1])
        finally:
            if running is not None:
                running.close()
    if turns.partition_graphs is not None:
        runner.release_partition_graphs(turns.partition_graphs)  # before the green context can go
    return rows


def _row(turns: LaterTurns, prefix: int, new: int, batch: int, context: int, repeats: int,
         running: RunningBatch | None) -> dict[str, Any]:
    times, gaps, plain = [], [], []
    for i in range(repeats + 1):
        if running is not None:
            plain += [g for g in (running.step() for _ in range(PLAIN_STEPS)) if g is not None]
        ms, gap = turns.turn_ms(prefix, new, running)
        if i > 0:  # the first compiles and plans what this shape needs
            times.append(ms)
            if gap is not None:
                gaps.append(gap)
    row: dict[str, Any] = {"prefix": prefix, "new": new, "batch": batch, "ms": round(statistics.median(times), 3),
                           "min_ms": round(min(times), 3), "repeats": repeats}
    if running is not None:
        row.update(context=context, overlap_steps=running.overlap,
                   gap_ms=round(statistics.median(gaps), 3) if gaps else None,
                   step_ms=round(statistics.median(plain), 3) if plain else None)
    return row


def print_row(row: dict[str, Any]) -> None:
    beside = "" if not row["batch"] else (f"  beside batch {row['batch']:>3}: gap {row['gap_ms'] or float('nan'):8.2f}"
                                          f" ms, step {row['step_ms'] or float('nan'):7.2f} ms")
    print(f"later turn: prefix {row['prefix']:>6} new {row['new']:>5}  {row['ms']:8.2f} ms "
          f"(min {row['min_ms']:.2f}){beside}", flush=True)
    if host := row.get("host"):
        top = ", ".join(f"{f['function']} {f['self_ms']:.1f} ms" for f in host["costliest"][:3])
        print(f"  under cProfile: {host['ms']:.2f} ms, kernels queued at {host['queued_ms']:.2f} ms, "
              f"{host['triton_launches']} Triton launches; most of the host's own time: {top}", flush=True)
