"""`python -m bench.micro.render_worker`: what the HTTP API's render worker (`decode_server.chat_render_pool`)
costs to start: seconds from `start()` until it answers, its resident memory, and whether torch or
xgrammar got into it, over `--repeats` fresh workers with the tiny preset's tokenizer. `--json` writes
them with the date, hardware, commit and command."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from decode_server.chat_render_pool import ChatRenderPool
from engine.byte_tokenizer import byte_tokenizer


def one_start() -> dict[str, float | bool]:
    pool = ChatRenderPool(byte_tokenizer())
    started = time.perf_counter()
    pool.start()
    pid = pool.wait_started()[0]
    ready_s = time.perf_counter() - started
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    maps = Path(f"/proc/{pid}/maps").read_text()
    pool.close()
    return {"ready_s": ready_s, "rss_mb": rss_kb / 1024, "torch": "libtorch" in maps, "xgrammar": "xgrammar" in maps}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.render_worker", description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = [one_start() for _ in range(args.repeats)]
    ready = statistics.median(float(r["ready_s"]) for r in runs)
    rss = statistics.median(float(r["rss_mb"]) for r in runs)
    loaded = {lib: any(bool(r[lib]) for r in runs) for lib in ("torch", "xgrammar")}
    print(f"render worker: ready in {ready:.2f} s, {rss:.0f} MB resident (median of {args.repeats}); "
          f"torch loaded: {loaded['torch']}, xgrammar loaded: {loaded['xgrammar']}")
    if args.json:
        # imported here: the worker is spawned, so it imports this module, and bench.common imports torch
        from bench.common import metadata, write_json

        write_json(args.json, {**metadata(), "ready_s_median": round(ready, 3), "rss_mb_median": round(rss, 1),
                               **{f"{lib}_loaded": v for lib, v in loaded.items()}, "runs": runs})


if __name__ == "__main__":
    main()
