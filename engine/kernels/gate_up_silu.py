"""The prefill MLP's first half, SiLU(x Wg^T) * (x Wu^T), as one Hopper GEMM (Gluon: TMA loads into
a ring of shared-memory stages, asynchronous warpgroup MMAs) whose epilogue applies SiLU·mul before
the store, so the [rows, 2 * intermediate] gate/up intermediate never reaches HBM and the SiLU·mul
kernel (24 ms of HBM traffic in a 32k prefill) disappears.

A program per SM walks BLOCK_M x BLOCK_N tiles of the output. For each it loads the tile's gate rows
and up rows of the weight as one [2 * BLOCK_N, BLOCK_K] operand, so one accumulator holds gate in
its first BLOCK_N columns and up in the rest. Columns of the last tile past the intermediate size
read the wrong rows but are never stored. Rounding follows the unfused path: gate and up to the
model dtype (the matmul's output), SiLU to the model dtype, the product too.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
STAGES = 4       # 4 x 48 KB of operands + a 32 KB output tile: within the 227 KB an SM gives a block
GROUP_M = 16     # row tiles that share each column strip of the weights while it is in L2 (bench.micro.fused_mlp)
NUM_WARPS = 8    # two warpgroups, each 64 rows of the tile


@gluon.jit
def _tile_offsets(tile, num_m, num_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row tiles walk each column strip of the weights together, so a strip
    is read from HBM about once and then from L2."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % size_m) * BM, ((tile % in_group) // size_m) * BN


@gluon.jit
def _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, step, num_k, num_m, num_n, inter, total, pid, nprog,
               STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Issue the TMA loads of this program's `step`-th (tile, k) step into its ring stage: x's rows,
    and the tile's gate rows and up rows stacked as one [2 * BN, BK] operand."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    off_m, off_n = _tile_offsets(pid + (step // num_k) * nprog, num_m, num_n, BM, BN, GROUP_M)
    k = (step % num_k) * BK
    stage = step % STAGES
    pred = step < total
    bar = bars.index(stage)
    w_buf = w_bufs.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(w_desc, [off_n, k], bar, w_buf.slice(0, BN), pred)
    tma.async_copy_global_to_shared(w_desc, [inter + off_n, k], bar, w_buf.slice(BN, BN), pred)


@gluon.jit
def _gate_up_silu_kernel(x_desc, w_desc, out_desc, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         num_warps: gl.constexpr):
    """Persistent: program p takes tiles p, p + programs, ...; its (tile, k) steps form one stream
    through the ring, so the next tile's first loads are in flight during this tile's last MMAs
    and its epilogue. One m64 x n(2 BN) instruction per warpgroup and k16 covers gate and up."""
    BM: gl.constexpr = out_desc.block_type.shape[0]
    BN: gl.constexpr = out_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    inter = out_desc.shape[1]
    num_m = gl.cdiv(x_desc.shape[0], BM)
    num_n = gl.cdiv(inter, BN)
    num_k = gl.cdiv(x_desc.shape[1], BK)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    total = gl.cdiv(num_m * num_n - pid, nprog) * num_k

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * BN, BK], w_desc.layout)
    out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # Warps stacked along M: each warpgroup owns 64 rows and all 2 * BN columns (gate, then up).
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 2 * BN, 16])
    acc = gl.zeros((BM, 2 * BN), dtype=gl.float32, layout=acc_layout)

    for s in gl.static_range(STAGES - 1):
        _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, s, num_k, num_m, num_n, inter, total, pid, nprog, STAGES,
                   GROUP_M)
    step = 0
    for tile in range(pid, num_m * num_n, nprog):
        for ki in range(num_k):
            stage = step % STAGES
            mbarrier.wait(bars.index(stage), (step // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(stage), w_bufs.index(stage).permute((1, 0)), acc, use_acc=ki > 0,
                                is_async=True)
            # This step's MMA stays in flight; the previous step's is done, so its stage is free.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, step + STAGES - 1, num_k, num_m, num_n, inter, total,
                       pid, nprog, STAGES, GROUP_M)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Column c < BN of a thread's accumulator is gate, c + BN is up, held by the same thread.
        gate, up = acc.reshape([BM, 2, BN]).permute((0, 2, 1)).split()
        g = gate.to(dtype).to(gl.float32)
        silu = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
        y = (silu * up.to(dtype).to(gl.float32)).to(dtype)
        tma.store_wait(pendings=0)  # the previous tile's store has left out_smem
        out_smem.store(y)
        fence_async_shared()
        off_m, off_n = _tile_offsets(tile, num_m, num_n, BM, BN, GROUP_M)
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def supports(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Hopper, 16-bit operands, contiguous rows whose strides TMA can address."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
            and x.dtype in (torch.bfloat16, torch.float16) and gate_up.dtype == x.dtype
            and x.dim() == 2 and x.is_contiguous() and gate_up.is_contiguous()
            and x.shape[1] % 8 == 0 and (gate_up.shape[0] // 2) % 8 == 0)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, stages: int = STAGES, group_m: int = GROUP_M) -> torch.Tensor:
    """x [rows, hidden], gate_up [2 * intermediate, hidden] (gate rows, then up rows) ->
    SiLU(x gate^T) * (x up^T) [rows, intermediate]. `stages` and `group_m` are for benchmarks."""
    rows, _ = x.shape
    inter = gate_up.shape[0] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(rows, BLOCK_M) * triton.cdiv(inter, BLOCK_N)
    grid = (min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count),)
    _gate_up_silu_kernel[grid](_desc(x, [BLOCK_M, BLOCK_K]), _desc(gate_up, [BLOCK_N, BLOCK_K]),
                               _desc(out, [BLOCK_M, BLOCK_N]), stages, group_m, num_warps=NUM_WARPS)
    return out
