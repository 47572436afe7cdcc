"""What every benchmark records beside its figures: date, hardware, commit, command, ceilings."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from client.provenance import git_commit

REPO = Path(__file__).resolve().parent.parent


def hardware() -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _module_run() -> str:
    """The running benchmark's module (`bench.micro.gemv`), from its file's path under the repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        return ".".join(script.relative_to(REPO).with_suffix("").parts)
    except ValueError:  # a script outside this tree: its folder and name
        return script.parent.name + "." + script.stem


def metadata() -> dict[str, Any]:
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "hardware": hardware(), "commit": git_commit(),
            "command": "python -m " + shlex.join([_module_run(), *sys.argv[1:]]), "torch": torch.__version__}


def tokenizer_args(preset: str) -> list[str]:
    """`--tokenizer` for a preset without one of its own (all but tiny): the tiny preset's byte-level
    tokenizer (ids 0-319 of the model's vocabulary), saved to a fresh folder, so that text prompts,
    chats and grammars run on a real model's shape."""
    if preset == "tiny":
        return []
    import tempfile

    from engine.byte_tokenizer import byte_tokenizer

    folder = tempfile.mkdtemp(prefix="byte-tokenizer-")
    byte_tokenizer().hf.save_pretrained(folder)
    return ["--tokenizer", folder]


def changed_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Iterable[str]) -> str:
    """Those of `names` (argparse dests) given a value other than their default, as flags ("--a, --b"); "" if
    none: what a benchmark would take and ignore in the mode it runs, and so refuses."""
    return ", ".join("--" + name.replace("_", "-") for name in names if getattr(args, name) != parser.get_default(name))


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def write_gpu_rows(path: str | Path, hbm_gbps: float, rows: list[dict[str, Any]]) -> None:
    """A one-GPU sweep's rows with the run's provenance, the GPU and the HBM copy rate it measured."""
    write_json(path, {**metadata(), "gpu": torch.cuda.get_device_name(0), "hbm_gbps_measured": round(hbm_gbps, 1),
                      "rows": rows})
    print(f"wrote {path}")


def time_cuda(fn: Any, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() by CUDA events (each call timed on its own)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Milliseconds per replay of a captured CUDA graph, back to back, timed by device events (after
    one replay that is not timed)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def measure_hbm_gbps(device: torch.device, gib: float = 4.0) -> float:
    """Device-to-device copy, counting bytes read plus written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=10)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def measure_bf16_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = time_cuda(lambda: a @ b, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12
