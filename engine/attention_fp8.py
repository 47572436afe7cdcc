"""Whole-prompt causal attention on FP8 tensor cores, for servers whose KV pool is e4m3.

With `--kv-cache-dtype fp8` on Hopper, a whole prompt's attention runs through cuDNN's FP8 attention
(cudnn-frontend's `sdpa_fp8`, the kernel behind TransformerEngine's FP8 attention):

- k and v are rounded as the pool stores them (`kv_cache.to_kv_dtype`: scale 1.0, saturating at
  448), so the prefill attends to the values every later decode step reads;
- q is taken to e4m3 with one scale, its largest magnitude to 448, computed on the device (no sync);
- the softmax probabilities are multiplied by 448 before cuDNN rounds them to e4m3 for the P·V
  product, and divided after;
- O comes out in e4m3 (on Hopper cuDNN writes FP8 attention's output in FP8 only), scaled by the
  power of two that takes v's largest magnitude (O's bound) nearest below 448, then back to the
  model's dtype exactly.

cuDNN builds an execution plan per shape; `attention.attention_rows` bounds the shapes, and plans
(with their cuDNN handle) are cached per thread, as PyTorch caches its own cuDNN plans. A shape cuDNN
has no FP8 plan for is answered by the 16-bit route (`supports`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine.fp8 import FP8_MAX
from engine.kv_cache import FP8_KV_MAX, to_kv_dtype

log = logging.getLogger(__name__)

# Shorter prompts attend in 16 bits: at Qwen2.5-7B's shape FP8 attention (with its conversions) measured
# slower than the bf16 route up to 12k rows, level at 16k and 11-23% faster from 24k
# (`python -m bench.micro.attention --fp8`, bench/results/attention-fp8-h200.json)
MIN_ROWS = 18432
_TINY = 1e-12     # an all-zero q keeps a finite scale


def available(device: torch.device) -> bool:
    """Whether FP8 attention can run here: a Hopper-or-later GPU and cudnn-frontend installed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _Plan:
    graph: Any
    kv_heads: int            # k and v's heads as the plan takes them (the query's where cuDNN takes no GQA)
    q: Any
    k: Any
    v: Any
    o: Any
    scales: dict[str, Any]   # descale_q/k/v/s, scale_s, scale_o: [1, 1, 1, 1] float32 inputs
    amax: tuple[Any, Any]    # amax of S and of O: outputs cuDNN insists on
    workspace: int


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.handles: dict[int, int] = {}
        self.plans: dict[tuple[int, ...], _Plan | None] = {}  # None: cuDNN has no FP8 plan for the shape
        self.constants: dict[int, torch.Tensor] = {}  # a device's [1, 1/448, 448] as float32


_state = _ThreadState()


def _bshd(rows: int, heads: int, dim: int) -> tuple[list[int], list[int]]:
    """dims and strides of a token-major [rows, heads, dim] tensor as cuDNN's [1, heads, rows, dim]."""
    return [1, heads, rows, dim], [rows * heads * dim, dim, heads * dim, 1]


def _handle(device: torch.device) -> int:
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _state.handles.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _state.handles[index] = cudnn.create_handle()
    return handle


def supports(rows: int, heads: int, kv_heads: int, dim: int, device: torch.device) -> bool:
    """Whether cuDNN has an FP8 plan for this shape here (built now if not yet, then kept)."""
    return _plan(rows, heads, kv_heads, dim, device) is not None


def _plan(rows: int, heads: int, kv_heads: int, dim: int, device: torch.device) -> _Plan | None:
    import cudnn

    key = (device.index or 0, rows, heads, kv_heads, dim)
    if key not in _state.plans:
        plan = None
        for plan_kv_heads in dict.fromkeys((kv_heads, heads)):  # else K and V expanded to the query's heads
            try:
                plan = _build(rows, heads, plan_kv_heads, dim, device)
                break
            except cudnn.cudnnGraphNotSupportedError as e:
                log.warning("cuDNN has no FP8 attention plan for %d rows, %d/%d heads of %d: %s", rows, heads,
                            plan_kv_heads, dim, str(e).splitlines()[0])
        _state.plans[key] = plan
    return _state.plans[key]


def _build(rows: int, heads: int, kv_heads: int, dim: int, device: torch.device) -> _Plan:
    import cudnn

    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                          handle=_handle(device))
    q = graph.tensor(name="q", dim=_bshd(rows, heads, dim)[0], stride=_bshd(rows, heads, dim)[1], data_type=fp8)
    k_dim, k_stride = _bshd(rows, kv_heads, dim)
    k = graph.tensor(name="k", dim=k_dim, stride=k_stride, data_type=fp8)
    v = graph.tensor(name="v", dim=k_dim, stride=k_stride, data_type=fp8)
    scales = {name: graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
              for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, **scales, generate_stats=False,
                                          attn_scale=dim ** -0.5, use_causal_mask=True)
    o.set_output(True).set_dim(_bshd(rows, heads, dim)[0]).set_stride(_bshd(rows, heads, dim)[1])
    o.set_data_type(fp8)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return _Plan(graph, kv_heads, q, k, v, o, scales, (amax_s, amax_o), graph.get_workspace_size())


def _constants(device: torch.device) -> torch.Tensor:
    index = device.index or 0
    const = _state.constants.get(index)
    if const is None:
        const = _state.constants[index] = torch.tensor([1.0, 1.0 / FP8_MAX, FP8_MAX], dtype=torch.float32,
                                                       device=device)
    return const


def quantize_q(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q in e4m3 with one scale (its largest magnitude to 448), and the float32 factor back: q ≈ q8 * descale.
    The factor is rounded to q's dtype before the product, so descale is its exact inverse."""
    amax = torch.linalg.vector_norm(q, ord=float("inf"), dtype=torch.float32).clamp(min=_TINY)
    factor = (FP8_MAX / amax).to(q.dtype)
    return (q * factor).to(torch.float8_e4m3fn), factor.float().reciprocal().reshape(1, 1, 1, 1)


def fp8_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over q [T, H, D], k/v [T, Hkv, D] (16-bit, token-major, contiguous) from position 0
    -> [T, H, D] in q's dtype. Rows of zeros after the prompt leave its rows as they are (causal)."""
    import cudnn

    rows, heads, dim = q.shape
    plan = _plan(rows, heads, k.shape[1], dim, q.device)
    if plan is None:
        raise ValueError(f"cuDNN has no FP8 attention plan for q {tuple(q.shape)}, k {tuple(k.shape)}")
    q8, descale_q = quantize_q(q)
    k8, v8 = (to_kv_dtype(t, torch.float8_e4m3fn) for t in (k, v))
    if plan.kv_heads != k.shape[1]:
        k8, v8 = (t.view(torch.uint8).repeat_interleave(heads // k.shape[1], 1).view(t.dtype) for t in (k8, v8))
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    const = _constants(q.device)
    one, inverse, full = const[0:1], const[1:2], const[2:3]
    # v as the pool rounds it saturates at FP8_KV_MAX, so O's bound does too
    v_amax = torch.linalg.vector_norm(v, ord=float("inf"), dtype=torch.float32).clamp(_TINY, FP8_KV_MAX)
    scale_o = torch.exp2(torch.floor(torch.log2(FP8_MAX / v_amax))).reshape(1, 1, 1, 1)  # |O| <= max |v|
    values = {"descale_q": descale_q, "descale_k": one, "descale_v": one, "descale_s": inverse, "scale_s": full,
              "scale_o": scale_o}
    amax = torch.empty(2, dtype=torch.float32, device=q.device)
    workspace = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=q.device)
    handle = _handle(q.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q.device).cuda_stream)
    pack = {plan.q: q8.data_ptr(), plan.k: k8.data_ptr(), plan.v: v8.data_ptr(), plan.o: out.data_ptr(),
            plan.amax[0]: amax[0:].data_ptr(), plan.amax[1]: amax[1:].data_ptr(),
            **{plan.scales[name]: t.data_ptr() for name, t in values.items()}}
    plan.graph.execute(pack, workspace.data_ptr(), handle=handle)
    return out.to(q.dtype).mul_(scale_o.reciprocal().to(q.dtype).flatten())  # a power of two: exact
