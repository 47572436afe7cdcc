"""Prefill server flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.server_config import ServerConfig, env_number, opt


@dataclass(frozen=True)
class PrefillConfig(ServerConfig):
    port: int = field(default=50052, metadata=opt("gRPC port"))
    metrics_port: int = field(default=8002, metadata=opt("Prometheus metrics HTTP port; 0 disables it"))
    kv_cache_gb: float | None = field(default=None, metadata=opt("KV pool size in GiB; default 8 on GPU "
                                                                  "(four 32k prompts in flight), 0.25 on CPU"))
    cuda_graphs: bool = field(default=True, metadata=opt(
        "replay prefills of up to 512 tokens as CUDA graphs, one a layer and a whole prompt's attention (GPU only)"))

    def kv_gb_default(self, on_gpu: bool) -> float | None:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb
        return 8.0 if on_gpu else None


# Fault injection, for tests only; read once at start-up. Declared here and nowhere else.
ENV_FAULT_LAYER_DELAY_S = "PD_FAULT_PREFILL_LAYER_DELAY_S"
ENV_FAULT_CORRUPT_KV = "PD_FAULT_PREFILL_CORRUPT_KV"


@dataclass(frozen=True)
class PrefillFaults:
    """`PD_FAULT_PREFILL_LAYER_DELAY_S=T`: the prefill worker sleeps T seconds after each layer (before
    that layer's KV is sent), so a test can kill or cancel a request mid-prefill and mid-transfer.
    `PD_FAULT_PREFILL_CORRUPT_KV=1`: once a prompt's KV is sent (gRPC transport), one bit of it flips in
    the pool, so the KV the decode side got differs from what the checksums are taken over."""

    layer_delay_s: float = 0.0
    corrupt_kv: bool = False

    @property
    def active(self) -> bool:
        return bool(self.layer_delay_s or self.corrupt_kv)

    @classmethod
    def from_env(cls) -> PrefillFaults:
        delay = env_number(ENV_FAULT_LAYER_DELAY_S, float, "seconds") or 0.0
        if not 0 <= delay <= 60:
            raise ValueError(f"{ENV_FAULT_LAYER_DELAY_S} must be in [0, 60] seconds, got {delay}")
        corrupt = env_number(ENV_FAULT_CORRUPT_KV, int, "0 or 1") or 0
        return cls(layer_delay_s=delay, corrupt_kv=bool(corrupt))
