"""`python -m bench.micro.mode_parity`: does each prefill mode leave the same sequence behind as one
whole-prompt prefill, and where its greedy tokens part from the whole prompt's, is it rounding?

For each prompt length, one random prompt is prefilled whole (the reference), in chunks of each
`--chunks` size (attention over the cached chunks, as the chunked mode runs it) and in layer slices
(the layered mode), then decoded greedily on its own for `--steps` tokens. Reported per mode: the
first step whose token differs from the reference, the relative error of the first logits and of
the KV cache (every layer) against the reference, and, at the step where the tokens part, the
reference's margin between its two best logits beside how far that step's logits are from the
reference's (both sequences are identical up to that step). Where twice that gap covers the margin
(each of the two logits may move by the gap), rounding explains the flip between near-tied tokens;
a bug shows as an O(1) error in the first logits or the KV.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch

from bench.common import metadata, write_json
from engine.decode_batch import DecodeSeq
from engine.device import DTYPES
from engine.offline import make_runner
from engine.runner import ModelRunner


@dataclass
class Run:
    tokens: list[int]
    logits: list[torch.Tensor]  # float32 [V] before each token
    kv: list[torch.Tensor]      # every layer's prompt KV, float32 [2, T, Hkv, D]


@dataclass
class Row:
    length: int
    mode: str
    first_token_equal: bool
    first_divergence: int | None      # step of the first differing token; None when all agree
    first_logits_rel_err: float
    kv_rel_err_max: float             # the worst layer's
    margin_at_divergence: float | None    # the reference's top-1 minus top-2 logit there
    logit_gap_at_divergence: float | None  # max |logit - reference logit| there
    rounding_flip: bool | None        # twice the gap covers the margin


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(runner: ModelRunner, prompt: list[int], steps: int, mode: str, layer_slice_tokens: int) -> Run:
    """Prefill `prompt` as `mode` says ("whole", "chunked:N", "layered"), then decode greedily."""
    pool = runner.pool
    table = pool.allocator.allocate(pool.blocks_needed(len(prompt) + steps))
    try:
        if mode == "layered":
            for out in runner.prefill_slices(prompt, table, layer_slice_tokens):
                logits = out
        else:
            step = int(mode.split(":")[1]) if mode.startswith("chunked:") else len(prompt)
            for start in range(0, len(prompt), step):
                logits = runner.prefill(prompt[start:start + step], table, start)
        assert logits is not None
        all_logits = [logits.float()]
        tokens = [int(logits.argmax())]
        for index in range(1, steps):
            step_logits, _ = runner.decode([DecodeSeq(tokens[-1], len(prompt) + index - 1, table)])
            all_logits.append(step_logits[0].float())
            tokens.append(int(step_logits[0].argmax()))
        slots = pool.slots(table, 0, len(prompt))
        kv = [pool.read(layer, slots).float().cpu() for layer in range(runner.config.num_layers)]
        return Run(tokens, [x.cpu() for x in all_logits], kv)
    finally:
        pool.allocator.free(table)


def compare(length: int, mode: str, ref: Run, got: Run) -> Row:
    diverged = next((i for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=True)) if a != b), None)
    margin = gap = None
    if diverged is not None:
        top = torch.topk(ref.logits[diverged], 2).values
        margin = float(top[0] - top[1])
        gap = float((got.logits[diverged] - ref.logits[diverged]).abs().max())
    return Row(length, mode, got.tokens[0] == ref.tokens[0], diverged, rel_err(got.logits[0], ref.logits[0]),
               max(rel_err(g, r) for g, r in zip(got.kv, ref.kv, strict=True)), margin, gap,
               None if margin is None or gap is None else 2 * gap >= margin)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.mode_parity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-7b")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, nargs="+", default=["bfloat16"])
    p.add_argument("--lens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--layer-slice-tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-cache-gb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    modes = [*(f"chunked:{c}" for c in args.chunks), "layered"]
    rows: list[dict[str, object]] = []
    print(f"{'dtype':>9} {'len':>6} {'mode':>13} {'first ok':>8} {'parts at':>8} {'logits err':>10} "
          f"{'KV err':>8} {'margin':>7} {'gap':>7}")
    for name in args.dtype:
        runner = make_runner(preset=args.preset, device=args.device, dtype=DTYPES[name], kv_gb=args.kv_cache_gb,
                             max_batch_size=1, max_model_len=max(args.lens) + args.steps, cuda_graphs=True)
        runner.prepare_engine_thread()
        for length in args.lens:
            seeded = torch.Generator().manual_seed(args.seed)
            prompt = torch.randint(0, runner.config.vocab_size, (length,), generator=seeded).tolist()
            ref = run(runner, prompt, args.steps, "whole", args.layer_slice_tokens)
            for mode in modes:
                row = compare(length, mode, ref, run(runner, prompt, args.steps, mode, args.layer_slice_tokens))
                rows.append({"dtype": name, **asdict(row)})
                fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
                print(f"{name:>9} {length:>6} {mode:>13} {str(row.first_token_equal):>8} "
                      f"{'-' if row.first_divergence is None else row.first_divergence:>8} "
                      f"{row.first_logits_rel_err:>10.2e} {row.kv_rel_err_max:>8.2e} "
                      f"{fmt(row.margin_at_divergence):>7} {fmt(row.logit_gap_at_divergence):>7}", flush=True)
        del runner
    if args.json:
        write_json(args.json, {**metadata(), "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda")
                               else None, "preset": args.preset, "steps": args.steps, "rows": rows})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
