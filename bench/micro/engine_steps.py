"""`python -m bench.micro.engine_steps`: decode step and prefill times of the engine on one GPU, each beside
its floor (bytes over measured HBM bandwidth; FLOPs over the measured bf16 matrix rate).

Two matrix rates: a short burst at boost clock, and the rate held for seconds once the card has
run into its power limit (a 32k prefill takes a second and runs at that limit, with the board power
and SM clock it ran at printed beside it: `bench.micro.gpu_power`).

Decode: every sequence has a real 1,024-token prefilled context; a step is what the decode
server runs (metadata upload, graph replay, greedy tokens read back, each step queued before the
last one's tokens are read unless --no-overlap-steps), timed by the host clock; beside it, the
step's graph alone timed on the device.

`--later-turns`: only a chat's later turns, a prefill of --new-lens tokens after --prefix-lens
tokens from the prefix cache, alone and beside decode batches (bench.micro.later_turns); on the CPU too
(`--device cpu`, the tiny preset), written to engine-later-turns-h200.json unless --json says.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.common import changed_flags, measure_bf16_tflops, measure_hbm_gbps, metadata, replay_ms, write_json
from bench.micro import later_turns
from bench.micro.decode_loop import DecodeLoop, sync
from bench.micro.gpu_power import PowerSampler, as_json, describe, pj_per_flop, sustained_bf16_tflops
from engine.decode_batch import DecodeSeq
from engine.green_context import GreenContexts, SmPartitions, Unconfined
from engine.offline import make_runner
from engine.ops import KernelOptions
from engine.runner import ModelRunner


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step must read: every weight but the embedding table (only B rows are read)."""
    return sum(p.numel() * p.element_size() for n, p in runner.model.named_parameters() if not n.startswith("embed"))


def decode_step_ms(runner: ModelRunner, batch: int, context: int, steps: int,
                   overlap: bool = True) -> tuple[float, float | None]:
    """The median host-timed step, and the GPU time of the step's graph alone (`graph_replay_ms`).
    `overlap`: as the decode server runs by default, each step is queued before the last one's
    tokens are read back, its rows taking those tokens on the device."""
    pool = runner.pool
    tables = [pool.allocator.allocate(pool.blocks_needed(context + steps + 8)) for _ in range(batch)]
    try:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, runner.config.vocab_size, (context,), generator=gen).tolist() for _ in tables]
        for prompt, table in zip(prompts, tables, strict=True):
            runner.prefill(prompt, table, 0)
        loop = DecodeLoop(runner, tables, context, overlap)
        times = []
        for _ in range(steps + 5):
            t0 = time.perf_counter()
            loop.step()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[5:]), graph_replay_ms(runner, batch)
    finally:
        sync(runner)
        for table in tables:
            pool.allocator.free(table)


def graph_replay_ms(runner: ModelRunner, batch: int, replays: int = 20) -> float | None:
    """The GPU time of one decode step alone: the batch's graph replayed back to back (each replay
    redoes the last step's metadata), timed by device events. The step time less this is what the
    host adds between steps. None without CUDA graphs."""
    if runner.graphs is None:
        return None
    return replay_ms(runner.graphs.graphs[runner.graphs.bucket_for(batch)], replays)


def profile_decode(runner: ModelRunner, batch: int, context: int, steps: int = 10) -> list[dict[str, Any]]:
    """Where a decode step's GPU time goes: kernels by total time over `steps` steps, printed, and
    returned per step (name, microseconds, launches)."""
    from torch.profiler import ProfilerActivity, profile

    pool = runner.pool
    tables = [pool.allocator.allocate(pool.blocks_needed(context + 64)) for _ in range(batch)]
    try:
        seqs = [DecodeSeq(1, context, t) for t in tables]
        runner.decode(seqs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.decode(seqs)[1].tolist()
        print(f"--- decode step profile, batch {batch} ({steps} steps) ---")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        # kernels only: their self time on the device (the CPU-side ops that launched them hold their total too)
        events = prof.key_averages()
        kernels = ([e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
                   or [e for e in events if e.self_device_time_total > 0])
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        return [{"kernel": e.key[:120], "us_per_step": round(e.self_device_time_total / steps, 2),
                 "launches_per_step": round(e.count / steps, 2)} for e in kernels[:25]]
    finally:
        for t in tables:
            pool.allocator.free(t)


@contextmanager
def prefill_prompt(runner: ModelRunner, length: int) -> Iterator[tuple[list[int], list[int]]]:
    """A random prompt of `length` tokens and a block table for it, freed afterwards."""
    pool = runner.pool
    table = pool.allocator.allocate(pool.blocks_needed(length))
    try:
        yield torch.randint(0, runner.config.vocab_size, (length,)).tolist(), table
    finally:
        pool.allocator.free(table)


def profile_prefill(runner: ModelRunner, length: int) -> None:
    """Where one prefill's GPU time goes, kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    with prefill_prompt(runner, length) as (prompt, table):
        runner.prefill(prompt, table, 0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.prefill(prompt, table, 0)
            torch.cuda.synchronize()
    print(f"--- prefill profile, {length} tokens ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


PREFILL_REPEATS = 2  # timed prefills a length, after a warm-up; the energy counter spans them all


def prefill_ms(runner: ModelRunner, length: int, repeats: int = PREFILL_REPEATS) -> tuple[float, PowerSampler]:
    """The fastest of `repeats` timed prefills after a warm-up, and the power, clock and energy
    they ran at (all of them together)."""
    times = []
    with prefill_prompt(runner, length) as (prompt, table):
        runner.prefill(prompt, table, 0)
        torch.cuda.synchronize()  # the warm-up's kernels outside the energy count
        with PowerSampler(runner.device) as sampler:
            for _ in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.prefill(prompt, table, 0)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
    return min(times), sampler


def prefill_flops(runner: ModelRunner, n: int) -> float:
    """The matmul FLOPs a prefill of n tokens needs: every layer's qkv projection for all n rows;
    attention, o_proj and the MLP for all rows but at the last layer (only the last row's logits
    are wanted, so only its row goes on there), and the logits of that row."""
    c, model = runner.config, runner.model
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    layer = model.layers[0]
    qkv = params(layer.qkv)
    rest = params(layer.o_proj) + params(layer.gate_up) + params(layer.down)
    linear = 2 * n * c.num_layers * qkv + 2 * (n * (c.num_layers - 1) + 1) * rest + 2 * params(model.lm_head)
    causal = 2 * n * n * c.num_heads * c.head_dim * (c.num_layers - 1)  # QK^T and PV, causal half each
    return float(linear + causal + 4 * n * c.num_heads * c.head_dim)


def energy(pj: float | None) -> str:
    return "" if pj is None else f", {pj:.3f} pJ/FLOP"


# The flags of one mode, and their defaults: given in the other mode they are refused, not ignored
STEP_DEFAULTS: dict[str, Any] = {"batches": [1, 8, 32, 64], "prefill_lens": [4096, 16384, 32768], "steps": 50}
TURN_DEFAULTS: dict[str, Any] = {"prefix_lens": [1024, 4096, 16384], "new_lens": [64, 128, 256, 400],
                                 "later_turn_batches": [0, 32], "later_turn_sms": 0, "repeats": 5, "device": "cuda:0"}


def with_mode_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args` with its mode's defaults filled in; exits in one line where a flag of the other mode was given
    (the parser's default for each is None, so any value given is a change)."""
    mine, other = (TURN_DEFAULTS, STEP_DEFAULTS) if args.later_turns else (STEP_DEFAULTS, TURN_DEFAULTS)
    if given := changed_flags(parser, args, other):
        sys.exit(f"error: {given}: --later-turns times later turns only; leave these out" if args.later_turns
                 else f"error: {given}: these set --later-turns' run; add --later-turns or leave them out")
    for name, default in mine.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.engine_steps", description=__doc__)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--batches", type=int, nargs="+", help=f"default {STEP_DEFAULTS['batches']}")
    p.add_argument("--prefill-lens", type=int, nargs="+", help=f"default {STEP_DEFAULTS['prefill_lens']}")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, help=f"default {STEP_DEFAULTS['steps']}")
    p.add_argument("--min-decode-bucket", type=int, default=1)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-overlap-steps", action="store_true",
                   help="read each step's tokens back before queuing the next (the decode server's --no-overlap-steps)")
    p.add_argument("--no-skinny-gemv", action="store_true", help="decode matmuls through cuBLAS only")
    p.add_argument("--no-pdl", action="store_true", help="our kernels without programmatic dependent launch")
    p.add_argument("--no-fused-gate-up", action="store_true",
                   help="prefill MLPs as cuBLAS gate/up then the SiLU·mul kernel, not one Gluon GEMM")
    p.add_argument("--json", default=None,
                   help="default bench/results/engine-h200.json (engine-later-turns-h200.json with --later-turns)")
    p.add_argument("--profile", action="store_true",
                   help="print the costliest kernels of a decode step at each --batches and of the longest prefill; "
                        "with --later-turns, one more turn a row under cProfile (the host's share, Triton launches)")
    p.add_argument("--later-turns", action="store_true",
                   help="time only later turns: a prefill of each --new-lens after each --prefix-lens cached "
                        "tokens (bench.micro.later_turns), alone and beside each --later-turn-batches decode batch")
    p.add_argument("--prefix-lens", type=int, nargs="+", help=f"default {TURN_DEFAULTS['prefix_lens']}")
    p.add_argument("--new-lens", type=int, nargs="+", help=f"default {TURN_DEFAULTS['new_lens']}")
    p.add_argument("--later-turn-batches", type=int, nargs="+",
                   help="running sequences (of --context tokens) beside the turn; 0: the turn alone "
                        f"(default {TURN_DEFAULTS['later_turn_batches']})")
    p.add_argument("--later-turn-sms", type=int,
                   help="run each later turn confined to this many SMs, as partitioned mode's prefill (alone only)")
    p.add_argument("--repeats", type=int, help=f"timed later turns a row, after an untimed one (default "
                                               f"{TURN_DEFAULTS['repeats']})")
    p.add_argument("--device", help="cpu runs --later-turns only (float32; for tests; default cuda:0)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="fp8: an e4m3 KV pool")
    args = with_mode_defaults(p, p.parse_args())
    kernels = KernelOptions(skinny_gemv=not args.no_skinny_gemv, fused_gate_up=not args.no_fused_gate_up,
                            pdl=not args.no_pdl)
    if args.later_turns:
        later_turns_main(args, kernels)
        return
    if not torch.cuda.is_available():
        sys.exit("error: bench.micro.engine_steps measures a GPU; none is visible")
    device = torch.device("cuda:0")
    hbm, tflops = measure_hbm_gbps(device), measure_bf16_tflops(device)
    held, held_power, held_pj = sustained_bf16_tflops(device)
    print(f"measured ceilings: HBM {hbm:,.0f} GB/s, bf16 matmul {tflops:,.0f} TFLOP/s in a burst, {held:,.0f} "
          f"held for seconds {describe(held_power)}{energy(held_pj)}", flush=True)
    runner = make_runner(preset=args.preset, device="cuda:0", dtype=torch.bfloat16, kv_gb=40.0,
                         max_batch_size=max(args.batches), max_model_len=max(*args.prefill_lens, args.context + 512),
                         cuda_graphs=not args.no_cuda_graphs, min_decode_bucket=args.min_decode_bucket,
                         kernels=kernels, kv_dtype=torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None)
    wbytes = weight_bytes(runner)
    doc = {**metadata(), "gpu": torch.cuda.get_device_name(0), "preset": args.preset, "context": args.context,
           "hbm_gbps_measured": round(hbm, 1), "bf16_tflops_measured": round(tflops, 1),
           "bf16_tflops_sustained": round(held, 1), "sustained_matmul_power": as_json(held_power),
           "sustained_matmul_pj_per_flop": rounded(held_pj),
           "weight_bytes": wbytes, "kv_cache_dtype": runner.layout.dtype,
           "cuda_graphs": not args.no_cuda_graphs, "overlap_steps": not args.no_overlap_steps,
           "min_decode_bucket": args.min_decode_bucket,
           "skinny_gemv": kernels.skinny_gemv,
           "fused_gate_up": kernels.fused_gate_up, "pdl": kernels.pdl,
           "decode_ms": {}, "decode_gpu_ms": {}, "decode_tok_per_s": {}, "decode_floor_ms": {},
           "prefill_ms": {}, "prefill_floor_ms": {},
           "prefill_floor_sustained_ms": {}, "prefill_power": {}, "prefill_pj_per_flop": {}}
    print(f"{'decode batch':>12} {'step ms':>9} {'GPU ms':>7} {'floor ms':>9} {'of BW':>6} {'tok/s':>9}")
    for batch in args.batches:
        ms, gpu_ms = decode_step_ms(runner, batch, args.context, args.steps, overlap=not args.no_overlap_steps)
        doc["decode_gpu_ms"][str(batch)] = rounded(gpu_ms)
        floor = (wbytes + batch * (args.context + 1) * runner.layout.bytes_per_token) / (hbm * 1e9) * 1e3
        doc["decode_ms"][str(batch)] = round(ms, 3)
        doc["decode_floor_ms"][str(batch)] = round(floor, 3)
        doc["decode_tok_per_s"][str(batch)] = round(batch / ms * 1e3, 1)
        gpu = float("nan") if gpu_ms is None else gpu_ms
        print(f"{batch:>12} {ms:>9.3f} {gpu:>7.3f} {floor:>9.3f} {floor / ms:>6.0%} {batch / ms * 1e3:>9,.0f}",
              flush=True)
    print(f"{'prefill len':>12} {'ms':>9} {'floor ms':>9} {'of peak':>7} {'held floor':>10} {'of held':>7}")
    for n in args.prefill_lens:
        ms, power = prefill_ms(runner, n, PREFILL_REPEATS)
        flops = prefill_flops(runner, n)
        floor, held_floor = flops / (tflops * 1e12) * 1e3, flops / (held * 1e12) * 1e3
        pj = pj_per_flop(power.reading, flops * PREFILL_REPEATS)
        doc["prefill_ms"][str(n)] = round(ms, 2)
        doc["prefill_floor_ms"][str(n)] = round(floor, 2)
        doc["prefill_floor_sustained_ms"][str(n)] = round(held_floor, 2)
        doc["prefill_power"][str(n)] = as_json(power.reading)
        doc["prefill_pj_per_flop"][str(n)] = rounded(pj)
        print(f"{n:>12} {ms:>9.1f} {floor:>9.1f} {floor / ms:>7.0%} {held_floor:>10.1f} {held_floor / ms:>7.0%}  "
              f"{describe(power.reading)}{energy(pj)}", flush=True)
    if args.profile:
        doc["decode_profile"] = {str(b): profile_decode(runner, b, args.context) for b in args.batches}
        profile_prefill(runner, max(args.prefill_lens))
    json_path = args.json or "bench/results/engine-h200.json"
    write_json(json_path, doc)
    print(f"wrote {json_path}")


def later_turns_main(args: argparse.Namespace, kernels: KernelOptions) -> None:
    """`--later-turns`: the engine's later-turn prefills after cached prefixes, alone and beside decode
    batches (bench.micro.later_turns), written with the run's settings."""
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("error: no GPU is visible; --device cpu runs the later turns on the CPU")
    batches = [b for b in args.later_turn_batches if b > 0]
    steps = later_turns.batch_steps(len(args.prefix_lens) * len(args.new_lens), args.repeats)
    runner = make_runner(preset=args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                         kv_gb=40.0 if cuda else 0.25, max_batch_size=max([1, *batches]),
                         max_model_len=max(max(args.prefix_lens) + max(args.new_lens) + 16, args.context + steps + 2),
                         cuda_graphs=cuda and not args.no_cuda_graphs, min_decode_bucket=args.min_decode_bucket,
                         kernels=kernels, kv_dtype=torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None)
    runner.bind_thread()
    partitions: SmPartitions | None = None
    if args.later_turn_sms:
        if batches:
            sys.exit("error: --later-turn-sms times the turns alone (partitioned mode decodes on another thread): "
                     "pass --later-turn-batches 0")
        partitions = GreenContexts(runner.device) if cuda else Unconfined()
        problem = partitions.check(args.later_turn_sms)
        if problem:
            sys.exit(f"error: --later-turn-sms {args.later_turn_sms}: {problem}")
    doc = {**metadata(), "gpu": torch.cuda.get_device_name(runner.device) if cuda else None, "preset": args.preset,
           "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
           "block_size": runner.layout.block_size, "cuda_graphs": runner.graphs is not None,
           "overlap_steps": not args.no_overlap_steps, "skinny_gemv": kernels.skinny_gemv,
           "fused_gate_up": kernels.fused_gate_up, "pdl": kernels.pdl, "kv_cache_dtype": runner.layout.dtype,
           "later_turns": later_turns.measure(runner, args.prefix_lens, args.new_lens, args.later_turn_batches,
                                              args.context, args.repeats, overlap=not args.no_overlap_steps,
                                              partitions=partitions, sms=args.later_turn_sms, profile=args.profile)}
    json_path = args.json or "bench/results/engine-later-turns-h200.json"
    write_json(json_path, doc)
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
