"""The engine's speed change by change (`python -m bench.micro.engine_steps`, once `bench.engine`), rendered
into docs/results.md by `python -m bench.readme_tables`: each run from engine-h200.json's chain of
`previous` runs, and the tree before a change from the same device call in engine-ab-h200.json."""

from __future__ import annotations

from bench.history import Doc, caption, link, load, run_at, span
from bench.markdown import table

FILE, AB = "engine-h200.json", "engine-ab-h200.json"
BATCH_1_MS, BATCH_64_TOKENS, PREFILL_32K_MS = 3.9, 12_000, 1_000  # the targets
PREFILL_TARGETS_MS = {4096: 110, 16384: 450, 32768: PREFILL_32K_MS}


def about(run: Doc, file: str = FILE) -> str:
    return (f"{run['hardware']}, {run['date'][:10]}, commit {run['commit']}, `{run['command']}`, {link(file)}"
            + (" (under `previous`)" if file == FILE and run is not load(FILE) else ""))


def ab_runs(*commits: str) -> tuple[Doc, list[Doc]]:
    """The comparison in engine-ab-h200.json whose runs include every one of `commits`, and its runs."""
    for comparison in load(AB)["comparisons"]:
        held = {run["commit"] for run in comparison.get("runs", [])}
        if set(commits) <= held:
            return comparison, comparison["runs"]
    raise KeyError(f"{AB} holds no comparison of {', '.join(commits)}")


def about_ab(comparison: Doc, runs: list[Doc]) -> str:
    commits = " against ".join(dict.fromkeys(run["commit"] for run in runs))
    return f"{comparison['hardware']}, {comparison['date'][:10]}, {commits}, `{comparison['command']}`, {link(AB)}"


def step(run: Doc, batch: int, digits: int = 3) -> str:
    return f"{run['decode_ms'][str(batch)]:.{digits}f} ms"


def tokens(run: Doc, batch: int) -> str:
    return f"{run['decode_tok_per_s'][str(batch)]:,.0f}"


def of_floor(run: Doc, batch: int) -> str:
    return f"{run['decode_floor_ms'][str(batch)] / run['decode_ms'][str(batch)]:.0%}"


def met(passed: list[bool]) -> str:
    if all(passed):
        return "met on both" if len(passed) == 2 else "met"
    if not any(passed):
        return "not met"
    return "met on the first" if passed[0] else "met on the second"


def power(run: Doc, tokens_: int) -> str:
    """The board's power and SM clock where the prefill ran at its power limit."""
    held = run.get("prefill_power", {}).get(str(tokens_))
    if not held or held["watts"] < 0.9 * held["limit_watts"]:
        return ""
    return f" ({held['watts']:.0f} W, {held['sm_mhz']:,.0f} MHz)"


def engine_two_cards() -> str:
    """The head on two cards, one run each (the second card's run is the newer, with its decode again)."""
    first, second = run_at(FILE, "8a44311"), run_at(FILE, "63489d1")
    again = second.get("again", {})
    decode = []
    for b in (1, 8, 32, 64):
        key = str(b)
        one, two = step(first, b), step(second, b)
        if b == 64:
            one += f" ({tokens(first, b)} tokens/s)"
            two += f" ({tokens(second, b)}" + (f"; {again['decode_tok_per_s'][key]:,.0f} again" if key in
                                               again.get("decode_tok_per_s", {}) else "") + ")"
        elif key in again.get("decode_ms", {}):
            two += f" ({again['decode_ms'][key]:.3f} again)"
        cards = [[first], [second] + ([again] if key in again.get("decode_ms", {}) else [])]
        target = ""
        if b == 1:
            target = f"≤ {BATCH_1_MS} ms: " + met([all(c["decode_ms"][key] <= BATCH_1_MS for c in card)
                                                 for card in cards])
        if b == 64:
            target = f"≥ {BATCH_64_TOKENS:,} tokens/s: " + met(
                [all(c["decode_tok_per_s"][key] >= BATCH_64_TOKENS for c in card) for card in cards])
        decode.append([f"batch {b}", one, two, f"{first['decode_floor_ms'][key]:.3f} ms", of_floor(first, b), target])
    prefill = []
    for n in (4096, 32768):
        key = str(n)
        times = [first["prefill_ms"][key], second["prefill_ms"][key]]
        floors = [first["prefill_floor_sustained_ms"][key], second["prefill_floor_sustained_ms"][key]]
        target = (f"≤ {PREFILL_32K_MS:,} ms: " + met([t <= PREFILL_32K_MS for t in times])) if n == 32768 else ""
        prefill.append([f"{n:,}", f"{times[0]:,.1f} ms{power(first, n)}", f"{times[1]:,.1f} ms{power(second, n)}",
                        span(floors, 1, " ms"), span([100 * f / t for f, t in zip(floors, times, strict=True)], 0,
                                                     "%", widen=False), target])
    head = caption(f"first card: {about(first)}", f"second card: {about(second)}")
    return (head + "\n\n" + table(["decode, 1k context", "first card", "second card", "floor", "of floor", "target"],
                                  decode)
            + "\n\n" + table(["prefill", "first card", "second card", "floor (held)", "of held", "target"], prefill))


def engine_b30d550() -> str:
    """The head at b30d550 beside the tree it was measured against in the stream-K call (another card)."""
    run = run_at(FILE, "b30d550")
    comparison, ab = ab_runs("d6f3072", "ae4d259")
    before = [r for r in ab if r["commit"] == "d6f3072"]

    def each(batch: int, key: str, fmt: str) -> list[str]:
        return [format(r[key][str(batch)], fmt) for r in before if str(batch) in r[key]]

    row = [f"{FILE} ({run['commit']})", *(step(run, b) for b in (1, 8, 32)),
           f"{step(run, 64)} ({tokens(run, 64)} tokens/s)", f"{run['prefill_ms']['32768']:,.1f} ms"]
    cells = [" / ".join(each(b, "decode_ms", ".3f")) + " ms" if each(b, "decode_ms", ".3f") else ""
             for b in (1, 8, 32)]
    card_before = [f"the card before ({AB}, {before[0]['commit']})", *cells,
                   " / ".join(each(64, "decode_ms", ".3f")) + " ms (" + " / ".join(each(64, "decode_tok_per_s", ",.0f"))
                   + " tokens/s)", ""]
    header = ["", "batch 1", "batch 8", "batch 32", "batch 64", "32k prefill"]
    return caption(about(run), about_ab(comparison, ab)) + "\n\n" + table(header, [row, card_before])


def engine_548117c() -> str:
    run = run_at(FILE, "548117c")
    header = ["batch 1", "batch 8", "batch 32", "batch 64", "4k prefill", "32k prefill"]
    row = [*(step(run, b) for b in (1, 8, 32)), f"{step(run, 64)} ({tokens(run, 64)} tokens/s)",
           *(f"{run['prefill_ms'][str(n)]:,.1f} ms" for n in (4096, 32768))]
    return caption(about(run)) + "\n\n" + table(header, [row])


def decode_table(run: Doc, before: Doc | None = None, graph: bool = False, digits: int = 3,
                 name: str | None = None) -> str:
    """A run's decode steps at 1k contexts: its time (beside the tree before it, and its graph alone, where
    given), the HBM floor, its share of the floor and its rate."""
    batches = sorted(int(b) for b in run["decode_ms"])
    header = ["decode, 1k context", *([before["commit"]] if before else []), name or run["commit"],
              *(["the graph alone"] if graph else []), "floor", "of floor", "tokens/s"]
    rows = [[f"batch {b}", *([step(before, b, digits)] if before else []), step(run, b, digits),
             *([f"{run['decode_gpu_ms'][str(b)]:.3f} ms"] if graph else []),
             f"{run['decode_floor_ms'][str(b)]:.{digits}f} ms", of_floor(run, b), tokens(run, b)] for b in batches]
    return table(header, rows)


def engine_at(commit: str) -> str:
    run = run_at(FILE, commit)
    return caption(about(run)) + "\n\n" + decode_table(run)


def engine_beside(commit: str, base: str, graph: bool = False) -> str:
    """A run beside the tree before it, both from the change's one device call in engine-ab-h200.json."""
    run = run_at(FILE, commit)
    comparison, ab = ab_runs(base, commit)
    before = next(r for r in ab if r["commit"] == base)
    return (caption(about(run), f"{base}: " + about_ab(comparison, ab)) + "\n\n"
            + decode_table(run, before, graph=graph))


def engine_a57ddac() -> str:
    """The run at a57ddac: decode steps against their floor, and each prefill against its floors, burst and
    held, with the board's power, SM clock and energy per FLOP."""
    run = run_at(FILE, "a57ddac")
    prefill = []
    for n in sorted(int(k) for k in run["prefill_ms"]):
        key = str(n)
        took, held = run["prefill_ms"][key], run["prefill_floor_sustained_ms"][key]
        board = run["prefill_power"][key]
        target = PREFILL_TARGETS_MS.get(n)
        prefill.append([f"{n:,}", f"{took:,.0f} ms", f"{run['prefill_floor_ms'][key]:,.0f} ms", f"{held:,.0f} ms",
                        f"{held / took:.0%}", f"{board['watts']:.0f} W, {board['sm_mhz']:,.0f} MHz",
                        f"{run['prefill_pj_per_flop'][key]:.2f} pJ/FLOP",
                        f"≤ {target:,} ms, {'met' if took <= target else 'not met'}" if target else ""])
    header = ["prefill", "time", "floor (burst)", "floor (held)", "of held", "board power, SM clock", "energy",
              "target"]
    note = (f"the card copied {run['hbm_gbps_measured']:,.0f} GB/s and held {run['bf16_tflops_sustained']:,.0f} "
            f"TFLOP/s of bf16 matmul ({run['bf16_tflops_measured']:,.0f} in a burst)")
    return (caption(about(run), note) + "\n\n" + decode_table(run, digits=2, name="step") + "\n\n"
            + table(header, prefill))
