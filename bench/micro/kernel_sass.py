"""`python -m bench.micro.kernel_sass`: a decode kernel compiled for sm_90a here (no GPU needed) with the
installed Triton and the assembler and disassembler it bundles, and what one step of its main loop costs
a warp in SASS instructions, by opcode, and its whole program a byte read.

An SM issues at most four warp-instructions a clock; where a kernel needs more a byte than it can issue
while HBM delivers that byte, the instructions, not the bytes, set its time. Kernels (`--kernel`):
- `attention`: the decode attention's split kernel, a step `block_n` tokens of K and V, at Qwen2.5-7B's
  shape (28 query heads, 4 KV heads, 128 dims, a split context, rope inside);
- `vector`: the e4m3 skinny matmul on CUDA cores (1-2 rows), a step `block_n` x `block_k` weights (twice
  that gated);
- `gemv`: the 64-row W8A8 tile of e4m3 weights (3-64 rows), a step `block_n` x `block_k` weights (twice
  that gated) and 64 x `block_k` of x, at Qwen2.5-7B's four projections: its shared memory and the
  programs an SM holds, beside the programs the shape launches, and the bytes of x each program reads
  again from L2 for each weight byte it streams from HBM (`--shapes`; `--gemv-tiles` compiles other
  tiles in the engine's place);
- `merge`: the attention's merge of a sequence's heads that writes o_proj's e4m3 rows (FP8 weights, 3-64
  rows), at each split count the engine picks there: the slices its loop adds a trip and the barriers in
  it (the whole program where the loop is unrolled). A trip waits on L2 at least once, and again after each
  barrier whose far side issues loads.
Every row carries a hash of its whole disassembly, and the output one of them all (`sass_digest`), so a
change meant to leave the machine code alone is checked by comparing trees
(`python -m bench.ab run --trees . .ab/REV --keys sass_digest -- python -m bench.micro.kernel_sass --json {json}`).
Each is compiled as the engine launches it, pointers and strides specialized as divisible by 16 as
Triton's runtime does (the block table's row stride and the merge's strides are not). The device may
run another Triton version, whose code can differ.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.common import changed_flags, metadata, write_json
from engine.kernels import gemv, gemv_vector, launch, paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 4, 128, 16
POINTERS = {"Q": "*bf16", "BT": "*i32", "BT_STRIDE": "*i32", "CTX": "*i32", "OUT": "*fp32", "ML": "*fp32",
            "RESULT": "*bf16", "POS": "*i32", "COS": "*fp32", "SIN": "*fp32", "SLOTS": "*i32"}
UNALIGNED = {"s_bt", "s_mh", "s_ms"}  # strides the runtime does not see divisible by 16
KV_TYPES = {"bf16": ("*bf16", 2), "fp8": ("*fp8e4nv", 1)}


# Qwen2.5-7B's projections: output columns, K, whether gate/up with SiLU·mul
PROJECTIONS = {"qkv": (4608, 3584, False), "o_proj": (3584, 3584, False), "gate_up": (37888, 3584, True),
               "down": (3584, 18944, False)}
SM_SHARED, SM_REGISTERS, SMS = 228 * 1024, 65536, 132  # an H100/H200 SM; SMs on an H200 SXM
SHARED_RESERVED = 1024  # a program's shared memory the driver keeps
ATTENTION_BATCH = 64  # the batch whose programs an attention row counts in waves (the capped tiles' largest)


@dataclass(frozen=True)
class LoopCost:
    registers: int
    spilled_bytes: int
    per_warp: int                       # instructions one warp issues in a step
    opcodes: list[tuple[str, int]]      # the same by opcode, most first
    sass_sha256: str = ""               # the whole program's disassembly, hashed: equal for the same machine code
    marked: int = 0                     # the step's instructions naming the marker


def _tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton bundles no {name}")
    return str(path)


def _compile(fn: triton.runtime.JITFunction, consts: dict[str, object], types: dict[str, str],
             options: dict[str, int | bool]) -> triton.compiler.CompiledKernel:
    """`fn` compiled for sm_90a: parameters typed by `types` (int32 otherwise), every one but the constexprs,
    float scalars and UNALIGNED strides specialized as divisible by 16, as Triton's runtime sees them."""
    signature = {p: "constexpr" if p in consts else types.get(p, "i32") for p in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.arg_names)
               if signature[p] not in ("constexpr", "fp32") and p not in UNALIGNED}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=aligned)
    options = {"enable_fp_fusion": launch.FP_FUSION, **options}  # as the engine launches them
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _options(num_warps: int, num_stages: int, max_registers: int | None) -> dict[str, int]:
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    return options


def compile_split_kernel(kv: str, tile: paged_decode.DecodeTile) -> tuple[str, int]:
    """The split kernel's PTX for sm_90a and the shared memory a program takes."""
    consts = dict(NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS, GROUP_PAD=16, HEAD_DIM=HEAD_DIM,
                  BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=tile.block_n, NUM_SPLITS=2, ROPE=True, STRIDE_ON_DEVICE=True,
                  PRECISION="tf32", F16_MMA=kv == "fp8", E4M3_WORDS=kv == "fp8" and tile.word_loads, WORDS_ASM=True,
                  PDL=True)
    types = {**POINTERS, "KV": KV_TYPES[kv][0], "scale_log2": "fp32"}
    options = _options(tile.num_warps, tile.num_stages, tile.max_registers)
    compiled = _compile(paged_decode._split_kernel, consts, types, options)
    return str(compiled.asm["ptx"]), int(compiled.metadata.shared)


def compile_vector_kernel(tile: gemv_vector.VectorConfig, gated: bool, x_bound: float = 0.0) -> str:
    """The CUDA-core skinny matmul's PTX for sm_90a (e4m3 weights, bf16 x, no bias, unsplit; x clamped to
    +-x_bound where it is above 0, a layer's `input_bound`)."""
    consts = dict(HAS_BIAS=False, GATED=gated, SPLIT_K=1, X_BOUND=x_bound, ROUND=triton.language.bfloat16,
                  BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
                  PDL=True)
    types = {"X": "*bf16", "W": "*fp8e4nv", "SCALE": "*fp32", "BIAS": "*fp32", "OUT": "*bf16", "PARTIAL": "*fp32",
             "COUNTS": "*i32"}
    return str(_compile(gemv_vector._vector_kernel, consts, types, {"num_warps": tile.num_warps}).asm["ptx"])


def compile_gemv_kernel(cfg: gemv.GemvConfig, gated: bool, bias: bool) -> tuple[str, int]:
    """The 64-row W8A8 tile's PTX for sm_90a as the engine launches it (x in e4m3 with its row scales)
    and the shared memory a program takes. A gated `cfg` is `gemv.gated_config_for`'s (each strip's half)."""
    consts = dict(HAS_SCALE=True, HAS_BIAS=bias, GATED=gated, ARGMAX=False, SPLIT_K=cfg.split_k, X_MODE=gemv.X_E4M3,
                  X_BOUND=0.0, ROUND=triton.language.bfloat16, BLOCK_M=gemv.WIDE_ROWS, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, STRIP_N=cfg.strip, PDL=True)
    types = {"X": "*fp8e4nv", "X_SCALE": "*fp32", "W": "*fp8e4nv", "SCALE": "*fp32", "BIAS": "*bf16",
             "OUT": "*bf16", "PARTIAL": "*fp32", "COUNTS": "*i32", "BEST": "*fp32", "BEST_COL": "*i32"}
    compiled = _compile(gemv._gemv_kernel, consts, types, _options(cfg.num_warps, cfg.num_stages, cfg.max_registers))
    return str(compiled.asm["ptx"]), int(compiled.metadata.shared)


def compile_merge_kernel(splits: int) -> str:
    """`_merge_rows_kernel`'s PTX for sm_90a at Qwen2.5-7B's heads and `splits` context slices."""
    consts = dict(HEADS=HEADS, HEADS_PAD=triton.next_power_of_2(HEADS), HEAD_DIM=HEAD_DIM, BLOCK_N=64,
                  NUM_SPLITS=splits, BOUND=0.0, PDL=True)
    types = {"OUT": "*fp32", "ML": "*fp32", "RESULT": "*bf16", "CTX": "*i32", "Q8": "*fp8e4nv", "SCALE": "*fp32"}
    options = {"num_warps": paged_decode.MERGE_ROWS_WARPS}
    return str(_compile(paged_decode._merge_rows_kernel, consts, types, options).asm["ptx"])


def loop_cost(ptx: str, marker: str = "MMA", unrolled_whole: bool = False) -> LoopCost:
    """Assemble and disassemble `ptx`; the main loop is the backward branch whose body holds the most
    instructions naming `marker` (the attention's tensor-core MMAs, the vector tile's FFMAs). With
    `unrolled_whole`, a program with no such loop counts whole, as one trip."""
    ptxas = _tool("ptxas-blackwell") if (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas-blackwell"
                                         ).exists() else _tool("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(ptx)
        built = subprocess.run([ptxas, "-v", "-arch=sm_90a", src, "-o", cubin], capture_output=True, text=True,
                               check=True)
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    registers = re.search(r"Used (\d+) registers", built.stderr)
    spills = re.search(r"(\d+) bytes spill stores", built.stderr)
    labels = {line.strip()[:-1]: i for i, line in enumerate(sass) if re.match(r"\s*\.L_x_\d+:", line)}
    loop: list[str] = []
    for i, line in enumerate(sass):
        branch = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if branch and labels.get(branch.group(1), i + 1) <= i:
            body = sass[labels[branch.group(1)]:i + 1]
            if sum(marker in s for s in body) > sum(marker in s for s in loop):
                loop = body
    if not loop and unrolled_whole:
        loop = sass
    opcodes: collections.Counter[str] = collections.Counter()
    for line in loop:
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            opcodes[op.group(1)] += 1
    if not opcodes:
        raise RuntimeError(f"no loop with a {marker} in the disassembly")
    return LoopCost(int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else 0,
                    sum(opcodes.values()), opcodes.most_common(), hashlib.sha256("\n".join(sass).encode()).hexdigest(),
                    sum(marker in line for line in loop))


def parse_tile(text: str) -> paged_decode.DecodeTile:
    """block_n:stages:warps[:max_registers[:words]], `words` for an e4m3 pool's word loads"""
    fields = text.split(":")
    words = len(fields) == 5 and fields.pop() == "words"
    try:
        parts = [int(p) for p in fields]
    except ValueError:
        parts = []
    if len(parts) not in (3, 4) or len(fields) != len(parts):
        raise argparse.ArgumentTypeError(f"tile {text!r}: block_n:stages:warps[:max_registers[:words]] expected")
    return paged_decode.DecodeTile(parts[0], parts[1], parts[2], (parts[3] or None) if len(parts) == 4 else None,
                                   words)


def attention_rows(kvs: list[str], tiles: list[paged_decode.DecodeTile] | None) -> list[dict[str, object]]:
    rows = []
    for kv in kvs:
        dtype = paged_decode.torch.float8_e4m3fn if kv == "fp8" else paged_decode.torch.bfloat16
        chosen = tiles or list(dict.fromkeys([paged_decode.decode_tile(dtype, 1),
                                              paged_decode.decode_tile(dtype, paged_decode.CAPPED_FROM_BATCH)]))
        for tile in chosen:
            ptx, shared = compile_split_kernel(kv, tile)
            cost = loop_cost(ptx)
            per_byte = cost.per_warp * tile.num_warps / (tile.block_n * HEAD_DIM * 2 * KV_TYPES[kv][1])
            cap = f", {tile.max_registers} registers at most" if tile.max_registers else ""
            name = f"attention {kv} {tile.block_n}x{tile.num_stages}x{tile.num_warps}w{cap}"
            per_sm = programs_per_sm(shared, cost.registers, tile.num_warps)
            programs = ATTENTION_BATCH * KV_HEADS * paged_decode.num_splits_for(ATTENTION_BATCH, KV_HEADS)
            print(f"{name:<48} {shared // 1024} KB shared, {per_sm} a SM: {programs} programs at batch "
                  f"{ATTENTION_BATCH} take {programs / (per_sm * SMS):.2f} waves on {SMS} SMs", flush=True)
            rows.append(_row(name, cost, per_byte, {"kernel": "attention", "kv_dtype": kv, **vars(tile),
                                                    "shared_bytes": shared, "programs_per_sm": per_sm}))
    return rows


def programs_per_sm(shared: int, registers: int, warps: int) -> int:
    """Programs an SM holds by its shared memory and its registers (a thread's count, 32 a warp)."""
    return min(SM_SHARED // (shared + SHARED_RESERVED), SM_REGISTERS // (max(registers, 1) * 32 * warps))


def vector_rows() -> list[dict[str, object]]:
    """Each shape's CUDA-core tile with a row a program and with every row of VECTOR_ROWS in one (the
    engine's at two rows); "a byte" is a byte of weight, whichever the rows."""
    rows = []
    for shape, one_row in gemv_vector.TILES.items():
        gated = shape == "wide"  # gate/up, SiLU·mul in the epilogue
        for tile in (one_row, replace(one_row, block_m=gemv_vector.VECTOR_ROWS)):
            cost = loop_cost(compile_vector_kernel(tile, gated), marker="FFMA")
            per_byte = cost.per_warp * tile.num_warps / (tile.block_n * tile.block_k * (2 if gated else 1))
            rows_each = f", {tile.block_m} rows a program" if tile.block_m > 1 else ""
            name = f"vector {shape} {tile.block_n}x{tile.block_k}x{tile.num_stages}x{tile.num_warps}w{rows_each}"
            rows.append(_row(name, cost, per_byte, {"kernel": "vector", "shape": shape, "gated": gated, **vars(tile)}))
    return rows


def parse_gemv_tile(text: str) -> gemv.GemvConfig:
    """block_n:block_k:warps:stages:split[:strip_n] (gate/up: block_n of each half)"""
    parts = [int(p) for p in text.split(":")]
    if len(parts) not in (5, 6):
        raise argparse.ArgumentTypeError(f"gemv tile {text!r}: block_n:block_k:warps:stages:split[:strip_n] expected")
    return gemv.GemvConfig(parts[0], parts[1], parts[2], parts[3], parts[4], quantize_x=True,
                           strip_n=parts[5] if len(parts) == 6 else 0)


def gemv_rows(shapes: list[str], tiles: list[gemv.GemvConfig] | None) -> list[dict[str, object]]:
    """Each shape's engine tile at 64 rows, or each of `tiles` in its place."""
    rows = []
    for shape in shapes:
        n, k, gated = PROJECTIONS[shape]
        engine = (gemv.gated_config_for if gated else gemv.config_for)(torch_e4m3_weight(n, k), gemv.WIDE_ROWS)
        for cfg in tiles or ([engine] if engine is not None else []):
            if gated and cfg.split_k > 1:  # `gemv._launch` refuses it: SiLU·mul needs the whole sums
                print(f"gemv {shape}: split {cfg.split_k} skipped, the gated tile is unsplit", flush=True)
                continue
            rows.append(_gemv_row(shape, n, k, gated, cfg))
    return rows


def _gemv_row(shape: str, n: int, k: int, gated: bool, cfg: gemv.GemvConfig) -> dict[str, object]:
    ptx, shared = compile_gemv_kernel(cfg, gated, bias=shape == "qkv")
    cost = loop_cost(ptx, marker="GMMA")
    columns = n // 2 if gated else n
    programs = -(-columns // cfg.strip) * cfg.split_k
    per_sm = programs_per_sm(shared, cost.registers, cfg.num_warps)
    weight_bytes = cfg.block_n * cfg.block_k * (2 if gated else 1)  # gated: a gate strip and its up strip
    per_byte = cost.per_warp * cfg.num_warps / (weight_bytes + gemv.WIDE_ROWS * cfg.block_k)
    x_reread = programs * gemv.WIDE_ROWS * (k // cfg.split_k) / (n * k)
    name = f"gemv {shape} {cfg.block_n}x{cfg.block_k}x{cfg.num_stages}x{cfg.num_warps}w split {cfg.split_k}"
    if cfg.strip_n:
        name += f" strip {cfg.strip_n}"
    print(f"{name:<48} {shared // 1024} KB shared, {per_sm} a SM, {programs} programs for {SMS} SMs, "
          f"{x_reread:.2f} B of x a weight byte", flush=True)
    return _row(name, cost, per_byte, {"kernel": "gemv", "shape": shape, "n": n, "k": k, "gated": gated, **vars(cfg),
                                       "shared_bytes": shared, "programs_per_sm": per_sm, "programs": programs,
                                       "x_bytes_per_weight_byte": round(x_reread, 3)})


def merge_rows() -> list[dict[str, object]]:
    """The merge at each split count of batches 3-64: a trip's instructions and the slices whose partials it
    loads, 16 bytes a load (a slice's partials: HEADS_PAD x HEAD_DIM float32)."""
    rows = []
    slice_bytes = triton.next_power_of_2(HEADS) * HEAD_DIM * 4
    for splits in sorted({paged_decode.num_splits_for(batch, KV_HEADS) for batch in range(3, 65)}):
        cost = loop_cost(compile_merge_kernel(splits), marker="LDG.E.128", unrolled_whole=True)
        per_trip = cost.marked * paged_decode.MERGE_ROWS_WARPS * 32 * 16 // slice_bytes
        barriers = dict(cost.opcodes).get("BAR", 0)  # a barrier between slices holds the next slice's loads back
        name = f"merge {splits} splits, {per_trip} slices and {barriers} barriers a trip"
        per_byte = cost.per_warp * paged_decode.MERGE_ROWS_WARPS / max(1, per_trip * slice_bytes)
        rows.append(_row(name, cost, per_byte, {"kernel": "merge", "splits": splits, "slices_per_trip": per_trip,
                                                "barriers_per_trip": barriers}))
    return rows


def torch_e4m3_weight(n: int, k: int) -> torch.Tensor:
    """An empty e4m3 weight of the shape, on the meta device: what the tile choice reads."""
    return torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")


def _row(name: str, cost: LoopCost, per_byte: float, fields: dict[str, object]) -> dict[str, object]:
    top = " ".join(f"{op} {n}" for op, n in cost.opcodes[:10])
    print(f"{name:<48} {cost.registers:>3} registers, {cost.spilled_bytes} B spilled, {cost.per_warp:>5} a warp a "
          f"step, {per_byte:.3f} a byte | {top}", flush=True)
    return {**fields, "registers": cost.registers, "spilled_bytes": cost.spilled_bytes,
            "instructions_per_warp_step": cost.per_warp, "instructions_per_byte": round(per_byte, 4),
            "opcodes": dict(cost.opcodes), "sass_sha256": cost.sass_sha256}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.micro.kernel_sass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    kernels = ["attention", "vector", "gemv", "merge"]
    p.add_argument("--kernel", choices=kernels, nargs="+", default=kernels)
    p.add_argument("--kv-dtype", choices=list(KV_TYPES), nargs="+", default=["bf16", "fp8"], help="attention's pool")
    p.add_argument("--tiles", type=parse_tile, nargs="+", default=None,
                   help="attention's block_n:stages:warps[:max_registers] (default: the engine's for the pool); "
                        "the vector kernel's are the engine's")
    p.add_argument("--shapes", choices=list(PROJECTIONS), nargs="+", default=list(PROJECTIONS), help="gemv's")
    p.add_argument("--gemv-tiles", type=parse_gemv_tile, nargs="+", default=None,
                   help="gemv's block_n:block_k:warps:stages:split[:strip_n] for each shape (default: the engine's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for kernel, names in (("attention", ["kv_dtype", "tiles"]), ("gemv", ["shapes", "gemv_tiles"])):
        if kernel not in args.kernel and (flags := changed_flags(p, args, names)):
            sys.exit(f"error: {flags}: {kernel}'s; add {kernel} to --kernel")
    rows = (attention_rows(args.kv_dtype, args.tiles) if "attention" in args.kernel else []) + \
        (vector_rows() if "vector" in args.kernel else []) + \
        (gemv_rows(args.shapes, args.gemv_tiles) if "gemv" in args.kernel else []) + \
        (merge_rows() if "merge" in args.kernel else [])
    # one hash of every row's machine code: two trees (`python -m bench.ab run ... --keys sass_digest`) compile
    # to the same kernels exactly where theirs match
    digest = hashlib.sha256(" ".join(str(row["sass_sha256"]) for row in rows).encode()).hexdigest()
    print(f"sass digest {digest}")
    if args.json:
        write_json(args.json, {**metadata(), "triton": triton.__version__, "target": "sm_90a", "rows": rows,
                               "sass_digest": digest})


if __name__ == "__main__":
    main()
