"""Options every server takes (host, ports, model, device, KV pool, TLS), validated once."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.presets import PRESETS
from engine.transport.base import KVTransport

KV_TRANSPORTS = ("auto", *KVTransport)


N = TypeVar("N", int, float)


def env_number(name: str, convert: Callable[[str], N], unit: str) -> N | None:
    """The number in $name (fault injection), None when unset or blank; one line naming it otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"{name} must be {unit}, got {raw!r}") from None


def opt(help_text: str, **extra: object) -> dict[str, object]:
    return {"help": help_text, **extra}


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=opt("address to bind; 0.0.0.0 in containers"))
    port: int = field(default=0, metadata=opt("gRPC port"))
    metrics_port: int = field(default=0, metadata=opt("Prometheus metrics HTTP port; 0 disables it"))
    model: str | None = field(default=None, metadata=opt("local Hugging Face checkpoint folder "
                                                          "(config.json + *.safetensors)"))
    preset: str | None = field(default=None, metadata=opt("built-in model with random weights; default: "
                                                           "qwen2.5-7b with a GPU, tiny without",
                                                           choices=sorted(PRESETS)))
    tokenizer: str | None = field(default=None, metadata=opt(
        "a local tokenizer folder (tokenizer.json) to read text with in place of the model's own: a preset's "
        "(which have none but tiny's) or a checkpoint's"))
    device: str = field(default="auto", metadata=opt("cpu, cuda:N, or auto (prefill GPU 0, decode GPU 1)"))
    dtype: str = field(default="auto", metadata=opt("auto (bfloat16 on GPU, float32 on CPU), float32, "
                                                     "bfloat16, float16"))
    quantization: str | None = field(default=None, metadata=opt(
        "fp8: quantize the decoder layers' weights to FP8 (e4m3, a scale per output channel) at load; FP8 "
        "checkpoints need no flag", choices=("fp8",)))
    kv_cache_dtype: str = field(default="auto", metadata=opt(
        "auto (the model's dtype) or fp8 (e4m3 at scale 1.0, a checkpoint's k/v scales folded into its weights: "
        "half the KV bytes in the pool and on every transport; both servers of a pair must agree)",
        choices=("auto", "fp8")))
    block_size: int = field(default=16, metadata=opt("KV pool block size in tokens"))
    kv_cache_gb: float | None = field(default=None, metadata=opt("KV pool size in GiB; default: free GPU "
                                                                  "memory less a reserve, 0.25 GiB on CPU"))
    max_model_len: int | None = field(default=None, metadata=opt("longest prompt + output; default: the "
                                                                  "model's, capped at 40960"))
    prefix_cache: bool = field(default=True, metadata=opt("keep the KV of full prompt blocks after a request, "
                                                           "and reuse it for prompts that start the same way"))
    kv_transport: str = field(default="auto", metadata=opt("KV data plane: grpc, nccl, cuda-ipc, nixl "
                                                            "(NIXL/UCX, docs/nixl.md); auto = nccl with GPUs, "
                                                            "grpc without", choices=KV_TRANSPORTS))
    max_queued_requests: int = field(default=256, metadata=opt("requests waiting beyond this get "
                                                                "RESOURCE_EXHAUSTED"))
    drain_timeout_s: float = field(default=30.0, metadata=opt("on SIGTERM, how long in-flight streams may "
                                                               "finish"))
    tls_cert: str | None = field(default=None, metadata=opt("PEM certificate chain; enables TLS"))
    tls_key: str | None = field(default=None, metadata=opt("PEM private key for --tls-cert"))
    tls_client_ca: str | None = field(default=None, metadata=opt(
        "PEM CA bundle: require a client certificate signed by it on every call (mutual TLS; needs --tls-cert)"))
    health_port: int = field(default=0, metadata=opt(
        "plaintext port that answers only grpc.health.v1, for probes that can't present a client "
        "certificate (the kubelet's); 0 disables it"))
    log_level: str = field(default="info", metadata=opt("debug, info, warning, error"))
    gil_switch_ms: float = field(default=5.0, metadata=opt("how long a busy Python thread may keep the GIL "
                                                             "before another takes it (sys.setswitchinterval); "
                                                             "lower gives the engine and KV threads it back "
                                                             "sooner from a busy event loop"))
    warm_up: str = field(default="auto", metadata=opt(
        "run every path a request can take once before serving (kernel compiles, attention plans, the "
        "allocator's largest blocks), each stage timed in the log; auto: on with a GPU, off on the CPU",
        choices=("auto", "on", "off")))
    skinny_gemv: bool = field(default=True, metadata=opt("decode-sized matmuls (16 rows, 64 where tuned) through our "
                                                          "Triton kernel rather than cuBLAS (GPU only)"))
    fused_gate_up: bool = field(default=True, metadata=opt("prefill-sized MLPs as one Gluon kernel (gate/up "
                                                            "GEMM with SiLU·mul) rather than cuBLAS then "
                                                            "SiLU·mul (Hopper GPUs only)"))
    pdl: bool = field(default=True, metadata=opt("launch our kernels with programmatic dependent launch, each "
                                                 "scheduled while the one before drains (Hopper GPUs only)"))

    def warms_up(self, device_type: str) -> bool:
        return self.warm_up == "on" or (self.warm_up == "auto" and device_type == "cuda")

    def __post_init__(self) -> None:
        if not all(0 <= p < 65536 for p in (self.port, self.metrics_port, self.health_port)):
            raise ValueError("ports must be in 0..65535")
        if self.model and self.preset:
            raise ValueError("pass either --model or --preset, not both")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked "
                             "only over TLS")
        if self.block_size < 1 or self.max_queued_requests < 1:
            raise ValueError("--block-size and --max-queued-requests must be positive")
        if not 0 < self.gil_switch_ms <= 1000:
            raise ValueError("--gil-switch-ms must be in (0, 1000]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
