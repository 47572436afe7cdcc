"""`python -m bench.micro.step_host_cost`: the engine thread's host time per decode step, by part, the
model's own forward left out; on the CPU (or a GPU: `--device cuda:0`).

The decode server's scheduler and overlapped steps (`BatchScheduler`, `DecodeSteps`) run --batch
sequences of the tiny preset (its byte-level tokenizer), --grammar-rows of them under the JSON
schema that bench.e2e.grammar_rows sends (compiled by xgrammar, as a request's would be), greedy
as the load sends them; then the same batch with no grammar; --rounds times in turn. A grammar row
whose JSON is done is replaced by a fresh one; the steps that prefill it are not counted. Each
part's time is its own (the parts it calls are counted apart), summed over a step; each figure is
the median over the counted steps:

- queue: runner.decode less the forward (the step's metadata), the rest of DecodeSteps._launch;
- sample_rows less the grammar's mask, and the mask (engine.grammar.apply);
- read: DecodeSteps._read less the hand-out, the hand-out (the scheduler's append less the
  sequence's), RequestSequence.append less the matchers, the matchers taking the tokens;
- the readers' wake-up, and the rest of the scheduler's step;
- left out of the host's total: the model's forward and the wait for the step's tokens
  (TokenReader.take). On the CPU the forward is by default (`--forward table`) a stand-in that gives
  each row the logits of a fixed random table's row picked by its input token and position (a few
  tensor ops, so that a step's host parts are not timed among the tiny model's own), or the tiny
  model eagerly (`--forward model`). On a GPU a step replays a CUDA graph, whose launch is in
  runner.decode; any wait for the device inside a part is in that part.

A grammar's mask costs in proportion to the vocabulary: the tiny preset's 320 tokens make it about
sixty times cheaper than a 152,064-token model's (bench/NOTES.md), so `--preset qwen2.5-7b` is the
figure for a real model's masks.

The CPU runs the eager path: its metadata is built as fresh tensors, where a GPU writes it into
the CUDA graphs' pinned buffers (`engine.cuda_graphs`); the rest is the same code. `--profile N`
prints cProfile's N costliest functions of the grammar batch's steps (by own time).

    python -m bench.micro.step_host_cost          # 64 rows, 8 under the grammar, 3 rounds of 200 steps each
    python -m bench.micro.step_host_cost --device cuda:0 --preset qwen2.5-7b --kv-gb 16 --json step-host-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from unittest.mock import patch

import torch

from bench.common import metadata, write_json
from bench.e2e.grammar_rows import SCHEMA
from decode_server import decode_steps
from decode_server.admission import Admission
from decode_server.config import PrefillMode
from decode_server.scheduler import BatchScheduler
from decode_server.sequence import RequestSequence
from engine import grammar
from engine.byte_tokenizer import byte_tokenizer
from engine.grammar import GrammarCompiler, GrammarState
from engine.grammar_spec import GrammarSpec
from engine.host_read import TokenReader
from engine.offline import make_runner
from engine.runner import ModelRunner
from engine.sampling import SamplingParams

FORWARD = "model forward (compute, left out)"
WAIT = "read: waiting for the device's tokens (left out)"
LEFT_OUT = (FORWARD, WAIT)
PARTS = ("queue: runner.decode less the forward", "queue: the rest of _launch",
         "sample_rows less the mask", "grammar mask (grammar.apply)",
         "read: _read less the hand-out", "hand-out: scheduler.append less seq.append",
         "hand-out: RequestSequence.append less the matchers", "grammar matchers taking the tokens",
         "wake the readers", "the rest of the scheduler's step")


class Parts:
    """Each wrapped call's own time (less the wrapped calls inside it), summed per label."""

    def __init__(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # the wrapped time inside each open call

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                inner = self._inner.pop()
                self.times[label] += elapsed - inner
                if self._inner:
                    self._inner[-1] += elapsed
        return timed

    def take(self) -> dict[str, float]:
        times, self.times = dict(self.times), defaultdict(float)
        return times


def table_forward(vocab: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A stand-in for the model's decode_forward: each row's logits a fixed random table's row, picked
    by its input token (fed from the last step's tokens where the row says) and position."""
    table = torch.randn(251, vocab, generator=torch.Generator().manual_seed(0))

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, pool: Any, meta: Any,
                feed: tuple[torch.Tensor, torch.Tensor] | None = None,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ids = input_ids
        if feed is not None:
            sources, previous = feed
            ids = torch.where(sources >= 0, previous[sources.clamp(min=0)], input_ids)
        logits = table[(ids * 31 + positions) % table.shape[0]]
        return logits, logits.argmax(dim=-1)

    return forward


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


@dataclass
class Steps:
    """A batch's counted steps: each part's seconds, the grammar rows in it; grammar rows replaced."""

    parts: list[dict[str, float]] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    replaced: int = 0

    def add(self, other: Steps) -> None:
        self.parts += other.parts
        self.grammar_rows += other.grammar_rows
        self.replaced += other.replaced

    def summary(self) -> dict[str, Any]:
        """Each part's median milliseconds a step, and the host's (every part but the forward)."""
        def median_ms(values: Iterable[float]) -> float:
            return round(statistics.median(values) * 1e3, 4)

        return {"steps": len(self.parts), "grammar_rows_min": min(self.grammar_rows),
                "grammar_rows_replaced": self.replaced,
                "host_ms_per_step": median_ms(sum(v for k, v in p.items() if k not in LEFT_OUT) for p in self.parts),
                "step_ms": median_ms(sum(p.values()) for p in self.parts),
                "parts_ms": {label: median_ms(p.get(label, 0.0) for p in self.parts) for label in (*PARTS, *LEFT_OUT)}}


def run_batch(runner: ModelRunner, loop: asyncio.AbstractEventLoop, args: argparse.Namespace, grammar_rows: int,
              profile: cProfile.Profile | None) -> Steps:
    """--steps steps of a full batch, each part timed."""
    eos = runner.config.eos_token_ids[0]
    compiled = (GrammarCompiler(byte_tokenizer(), runner.config.vocab_size, [eos])
                .compile(GrammarSpec("json_schema", json.dumps(SCHEMA))) if grammar_rows else None)
    s = BatchScheduler(runner, Admission(runner.pool, 4 * args.batch, 1 << 30, loop), max_batch_size=args.batch)
    every = args.batch // grammar_rows if grammar_rows else 0
    made = 0

    def submit(constrained: bool) -> RequestSequence:
        nonlocal made
        made += 1
        seq = RequestSequence(f"r{made}", prompt(args.prompt_len, made), args.steps + 2 * args.batch + 64,
                              SamplingParams(), frozenset(), frozenset({eos}) if constrained else frozenset(),
                              PrefillMode.COLOCATED, args.prompt_len, grammar=compiled if constrained else None)
        loop.run_until_complete(s.admission.reserve(seq))
        s.submit(seq)
        return seq

    for i in range(args.batch):
        submit(bool(every) and i % every == 0 and i // every < grammar_rows)
    while len(s.running) < args.batch or s.local.prefilling or s.ready or s.num_waiting:
        s.step()
    for _ in range(5):  # warm
        s.step()
    parts = Parts()
    wrap = parts.wrap
    per_step: list[dict[str, float]] = []
    live_grammar: list[int] = []  # grammar rows in each counted step
    finished = 0  # grammar rows that ended (their JSON done) and were replaced by a fresh one
    forward = (table_forward(runner.config.vocab_size) if args.forward == "table" and runner.graphs is None
               else runner.model.decode_forward)  # a CUDA graph's replay calls no forward: it is in the launch
    with (patch.object(runner.model, "decode_forward", wrap(FORWARD, forward)),
          patch.object(TokenReader, "take", wrap(WAIT, TokenReader.take)),
          patch.object(runner, "decode", wrap(PARTS[0], runner.decode)),
          patch.object(s.decode, "_launch", wrap(PARTS[1], s.decode._launch)),
          patch.object(decode_steps, "sample_rows", wrap(PARTS[2], decode_steps.sample_rows)),
          patch.object(grammar, "apply", wrap(PARTS[3], grammar.apply)),
          patch.object(s.decode, "_read", wrap(PARTS[4], s.decode._read)),
          patch.object(s, "append", wrap(PARTS[5], s.append)),
          patch.object(RequestSequence, "append", wrap(PARTS[6], RequestSequence.append)),
          patch.object(GrammarState, "accept", wrap(PARTS[7], GrammarState.accept)),
          patch.object(s, "_wake_readers", wrap(PARTS[8], s._wake_readers))):
        step = wrap(PARTS[9], s.step)
        while len(per_step) < args.steps:
            prefill = bool(s.local.prefilling or s.ready or s.num_waiting)  # a replacement's: not counted
            if profile is not None:
                profile.enable()
            step()
            if profile is not None:
                profile.disable()
            times = parts.take()
            live = sum(q.grammar is not None for q in s.running)
            if not prefill and len(s.running) == args.batch:
                per_step.append(times)
                live_grammar.append(live)
            for _ in range(args.batch - len(s.running) - s.num_waiting):  # a grammar row ended
                finished += 1
                submit(True)
            loop.run_until_complete(asyncio.sleep(0))  # the readers' wake-ups, untimed

    s.decode.abandon()
    for seq in [*s.running, *s.ready]:
        s.admission.release(seq)
    return Steps(per_step, live_grammar, finished)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.step_host_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cuda:N: the CUDA graphs' path, its forward a launch")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--kv-gb", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--grammar-rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="counted steps of each batch a round (default 200)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the batches in turn (default 3)")
    p.add_argument("--forward", choices=("table", "model"), default="table",
                   help="the decode step's forward: a table's rows (default) or the tiny model")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default 1: the host's own cost)")
    p.add_argument("--profile", type=int, default=0, help="print cProfile's N costliest functions (grammar batch)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not 0 <= args.grammar_rows <= args.batch:
        p.error("--grammar-rows must be between 0 and --batch")
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    runner = make_runner(preset=args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                         kv_gb=args.kv_gb, max_batch_size=args.batch, cuda_graphs=cuda,
                         max_model_len=args.prompt_len + args.steps + 2 * args.batch + 128)
    loop = asyncio.new_event_loop()
    profile = cProfile.Profile() if args.profile else None
    runs = {"unconstrained": (0, Steps()), **({"grammar": (args.grammar_rows, Steps())} if args.grammar_rows else {})}
    for _ in range(args.rounds):  # in turn, so that a slow spell of a shared machine falls on both
        for rows, steps in runs.values():
            steps.add(run_batch(runner, loop, args, rows, profile if rows else None))
    batches = {name: {"grammar_rows": rows, **steps.summary()} for name, (rows, steps) in runs.items()}
    print(f"{'part (median ms a step)':56s}" + "".join(f"{name:>15s}" for name in batches))
    for label in (*PARTS, *LEFT_OUT):
        print(f"{label:56s}" + "".join(f"{b['parts_ms'][label]:15.3f}" for b in batches.values()))
    for label, key in (("host total (less what is left out)", "host_ms_per_step"), ("step", "step_ms")):
        print(f"{label:56s}" + "".join(f"{b[key]:15.3f}" for b in batches.values()))
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.json:
        write_json(args.json, {**metadata(), "preset": args.preset, "device": args.device, "batch": args.batch,
                               "prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds,
                               "forward": "cuda graph" if cuda else args.forward, "threads": args.threads,
                               "batches": batches})


if __name__ == "__main__":
    main()
