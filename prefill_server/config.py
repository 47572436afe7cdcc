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

    def kv_gb_default(self, on_gpu: bool) -> float | None:
        if self.kv_cache_gb is not None:
            return self.kv_cache_gb
        return 8.0 if on_gpu else None


# Fault injection, for tests only; read once at start-up. Declared here and nowhere else.
ENV_FAULT_LAYER_DELAY_S = "PD_FAULT_PREFILL_LAYER_DELAY_S"


@dataclass(frozen=True)
class PrefillFaults:
    """`PD_FAULT_PREFILL_LAYER_DELAY_S=T`: the prefill worker sleeps T seconds after each layer (before
    that layer's KV is sent), so a test can kill or cancel a request mid-prefill and mid-transfer."""

    layer_delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> PrefillFaults:
        delay = env_number(ENV_FAULT_LAYER_DELAY_S, float, "seconds")
        if delay is None:
            return cls()
        if not 0 <= delay <= 60:
            raise ValueError(f"{ENV_FAULT_LAYER_DELAY_S} must be in [0, 60] seconds, got {delay}")
        return cls(layer_delay_s=delay)
