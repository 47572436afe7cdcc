"""The pair's handshake: KV layout check and transport choice, shared by both ends."""

from __future__ import annotations

import torch
from pd.v1 import prefill_pb2

from engine.kv_cache import KVLayout
from engine.transport.base import KVTransport


def layout_to_proto(layout: KVLayout) -> prefill_pb2.KVLayout:
    return prefill_pb2.KVLayout(model=layout.model, dtype=layout.dtype, num_layers=layout.num_layers,
                                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                block_size=layout.block_size, shape_order=layout.shape_order)


def layout_from_proto(msg: prefill_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
                    head_dim=msg.head_dim, block_size=msg.block_size, shape_order=msg.shape_order)


def layout_mismatch_message(decode: KVLayout, prefill: KVLayout) -> str | None:
    """One line naming both sides, or None when the layouts agree."""
    diff = prefill.mismatch(decode)
    if diff is None:
        return None
    sides = diff.replace("ours", "prefill server").replace("theirs", "decode server")
    return f"KV layout mismatch ({sides}); start both servers with the same model, --dtype and --kv-cache-dtype"


def supported_transports(device: torch.device, requested: str = "auto") -> list[KVTransport]:
    """What this end can do, best first: `auto`'s choices, and nixl when asked for by name (it pins
    the whole pool for NIXL, so auto never starts it)."""
    ours = [KVTransport.GRPC] if device.type != "cuda" else [KVTransport.NCCL, KVTransport.CUDA_IPC, KVTransport.GRPC]
    return [*ours, KVTransport.NIXL] if requested == KVTransport.NIXL else ours


def choose_transport(requested: str, ours: list[KVTransport], theirs: list[str]) -> KVTransport | None:
    """`requested` ('auto' or a transport's name) picked from what both ends support."""
    if requested != "auto":
        return KVTransport(requested) if requested in ours and requested in theirs else None
    for name in theirs:
        if name in ours:
            return KVTransport(name)
    return None
