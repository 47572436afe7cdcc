"""`python -m bench.micro.grammar_mask`: the host's cost of a decode step's grammar rows, piece by piece.

A batch of --batch rows of --vocab logits on the device, --rows of them under the JSON schema that
bench.e2e.grammar_rows sends, their matchers inside a string (the byte-level tokenizer, as the
benchmarks give a preset). Timed on the host, each the median of --repeats: the matchers taking a
token, the bitmask allocated and filled, pinned and copied, xgrammar's kernel applying it, and the
whole of engine.grammar.apply (the device synchronized after each piece, so a piece's queued work is
in its own time).

    python -m bench.micro.grammar_mask                     # a GPU: 64 rows, 8 under the grammar, 152,064 tokens
    python -m bench.micro.grammar_mask --device cpu --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import xgrammar as xgr

from bench.common import metadata, write_json
from bench.e2e.grammar_rows import SCHEMA
from engine.byte_tokenizer import byte_tokenizer
from engine.grammar import GrammarCompiler, GrammarState, apply
from engine.grammar_spec import GrammarSpec


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() on the host, the device synchronized after each call."""
    times = []
    for _ in range(repeats + 2):
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times[2:]), 4)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.grammar_mask", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    stop = [args.vocab - 1]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiled = GrammarCompiler(byte_tokenizer(), args.vocab, stop).compile(spec)
    states: list[GrammarState | None] = [None] * args.batch
    for k in range(args.rows):
        state = GrammarState(compiled, stop)
        for byte in b'{"answer":"':
            state.accept(byte)
        states[k * (args.batch // args.rows)] = state
    live = [s for s in states if s is not None]
    logits = torch.randn(args.batch, args.vocab, device=device)
    mask = xgr.allocate_token_bitmask(args.batch, args.vocab)
    rows = [i for i, s in enumerate(states) if s is not None]
    for k, s in zip(rows, live, strict=True):
        s.matcher.fill_next_token_bitmask(mask, k)
    on_device = mask.to(device)

    def fill() -> None:
        m = xgr.allocate_token_bitmask(args.batch, args.vocab)
        for k, s in zip(rows, live, strict=True):
            s.matcher.fill_next_token_bitmask(m, k)

    pieces = {
        "accept a token, every grammar row": lambda: [s.matcher.accept_token(ord("a")) for s in live],
        "allocate and fill the bitmask": fill,
        **({"pin and copy the bitmask": lambda: mask.pin_memory().to(device, non_blocking=True)}
           if device.type == "cuda" else {}),
        "xgrammar's kernel": lambda: xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=args.vocab,
                                                                     indices=rows),
        "a copy of the logits (sampling masks a copy)": lambda: logits.clone(),
        "engine.grammar.apply, whole": lambda: apply(logits, states),
    }
    ms = {name: timed(fn, device, args.repeats) for name, fn in pieces.items()}
    for name, value in ms.items():
        print(f"{value:8.3f} ms  {name}")
    if args.json:
        write_json(args.json, {**metadata(), "device": args.device, "batch": args.batch, "grammar_rows": args.rows,
                               "vocab": args.vocab, "host_ms": ms})


if __name__ == "__main__":
    main()
