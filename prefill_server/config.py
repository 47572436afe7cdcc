"""Prefill server flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.server_config import ServerConfig, opt


@dataclass(frozen=True)
class PrefillConfig(ServerConfig):
    port: int = field(default=50052, metadata=opt("gRPC port"))
    metrics_port: int = field(default=8002, metadata=opt("Prometheus metrics HTTP port; 0 disables it"))
    kv_cache_gb: float | None = field(default=None, metadata=opt("KV pool size in GiB; default 8 on GPU "
                                                                  "(four 32k prompts in flight), 0.25 on CPU"))
    advertise_host: str | None = field(default=None, metadata=opt("host the decode servers reach this one at "
                                                                   "for NCCL rendezvous; default: --host"))

    def kv_gb_default(self, on_gpu: bool) -> float | None:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb
        return 8.0 if on_gpu else None
