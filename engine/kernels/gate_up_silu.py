"""The prefill MLP's first half, SiLU(x Wg^T) * (x Wu^T), as one Hopper GEMM (Gluon: TMA loads into
a ring of shared-memory stages, asynchronous warpgroup MMAs) whose epilogue applies SiLU·mul before
the store, so the [rows, 2 * intermediate] gate/up intermediate never reaches HBM and the SiLU·mul
kernel (24 ms of HBM traffic in a 32k prefill) disappears.

Each program owns a BLOCK_M x BLOCK_N tile of the output and accumulates the matching tiles of gate
and of up in two register accumulators from the same rows of x. Rounding follows the unfused path:
gate and up to the model dtype (the matmul's output), SiLU to the model dtype, the product too.
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
GROUP_M = 8      # row tiles that share each column strip of the weights while it is in L2
NUM_WARPS = 8    # two warpgroups, each 64 rows of the tile


@gluon.jit
def _load_stage(x_desc, g_desc, u_desc, x_bufs, g_bufs, u_bufs, bars, stage, off_m, off_n, k, pred):
    bar = bars.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * g_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k], bar, x_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(g_desc, [off_n, k], bar, g_bufs.index(stage), pred)
    tma.async_copy_global_to_shared(u_desc, [off_n, k], bar, u_bufs.index(stage), pred)


@gluon.jit
def _gate_up_silu_kernel(x_desc, g_desc, u_desc, out_desc, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         num_warps: gl.constexpr):
    BM: gl.constexpr = out_desc.block_type.shape[0]
    BN: gl.constexpr = out_desc.block_type.shape[1]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    M = x_desc.shape[0]
    K = x_desc.shape[1]
    N = out_desc.shape[1]

    # Grouped order: GROUP_M row tiles walk each column strip together.
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BM)
    in_group = GROUP_M * gl.cdiv(N, BN)
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    off_m = (first_m + (pid % in_group) % size_m) * BM
    off_n = ((pid % in_group) // size_m) * BN

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
    u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    # Warps stacked along M: each warpgroup issues m64 x n(BN) x k16 instructions.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc_g = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
    acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)

    num_k = gl.cdiv(K, BK)
    for s in gl.static_range(STAGES - 1):
        _load_stage(x_desc, g_desc, u_desc, x_bufs, g_bufs, u_bufs, bars, s, off_m, off_n, s * BK, s < num_k)

    for ki in range(num_k):
        stage = ki % STAGES
        mbarrier.wait(bars.index(stage), (ki // STAGES) & 1)
        x = x_bufs.index(stage)
        acc_g = warpgroup_mma(x, g_bufs.index(stage).permute((1, 0)), acc_g, is_async=True)
        acc_u = warpgroup_mma(x, u_bufs.index(stage).permute((1, 0)), acc_u, is_async=True)
        # This step's two MMAs stay in flight; the previous step's are done, so its stage is free.
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        nk = ki + STAGES - 1
        _load_stage(x_desc, g_desc, u_desc, x_bufs, g_bufs, u_bufs, bars, nk % STAGES, off_m, off_n, nk * BK,
                    nk < num_k)
    acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    g = acc_g.to(dtype).to(gl.float32)
    s = (g / (1.0 + gl.exp(-g))).to(dtype).to(gl.float32)
    y = (s * acc_u.to(dtype).to(gl.float32)).to(dtype)
    out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    out_smem.store(y)
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
    tma.store_wait(pendings=0)


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
    grid = (triton.cdiv(rows, BLOCK_M) * triton.cdiv(inter, BLOCK_N),)
    _gate_up_silu_kernel[grid](_desc(x, [BLOCK_M, BLOCK_K]), _desc(gate_up[:inter], [BLOCK_N, BLOCK_K]),
                               _desc(gate_up[inter:], [BLOCK_N, BLOCK_K]), _desc(out, [BLOCK_M, BLOCK_N]),
                               stages, group_m, num_warps=NUM_WARPS)
    return out
