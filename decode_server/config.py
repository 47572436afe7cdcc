"""Decode server flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pd.v1 import decode_pb2

from decode_server.placement import PlacementThresholds
from serving.server_config import ServerConfig, env_number, opt

LOCAL_MODES = ("colocated", "chunked", "layered", "partitioned")
# The chunk sizes a chunked prefill may use (--chunk-size, a request's chunk_size): powers of two,
# each warmed up at start-up, so none compiles or plans on a request's path.
CHUNK_SIZES = tuple(1 << k for k in range(4, 14))


def chunk_size_problem(size: int) -> str | None:
    """Why `size` is not a chunk size this server takes, in words; None if it is."""
    if size in CHUNK_SIZES:
        return None
    return f"must be a power of two from {CHUNK_SIZES[0]} to {CHUNK_SIZES[-1]} (each is warmed up), got {size}"


class PrefillMode(StrEnum):
    """Where a prompt is prefilled: --mode's choices, and the request's prefill_mode as the proto
    numbers it (PREFILL_MODE_<NAME>; 0 = the server's --mode)."""

    COLOCATED = "colocated"          # here, the whole prompt in one step
    CHUNKED = "chunked"              # here, a chunk of the prompt between two decode steps
    LAYERED = "layered"              # here, a slice of the model's layers between two decode steps
    PARTITIONED = "partitioned"      # here, the whole prompt beside the decode steps, on a share of the SMs
    DISAGGREGATED = "disaggregated"  # on a prefill server, whose KV then comes over
    AUTO = "auto"                    # here (--auto-local-mode) or on a prefill server, chosen per request

    @property
    def number(self) -> int:
        return decode_pb2.PrefillMode.Value(f"PREFILL_MODE_{self.name}")

    @classmethod
    def from_number(cls, number: int) -> PrefillMode | None:
        """The mode a request's prefill_mode names; None for 0 (unset) or a number the proto does not know."""
        return next((mode for mode in cls if mode.number == number), None)


@dataclass(frozen=True)
class DecodeConfig(ServerConfig):
    port: int = field(default=50051, metadata=opt("gRPC port"))
    metrics_port: int = field(default=8001, metadata=opt("Prometheus metrics HTTP port; 0 disables it"))
    prefill_addr: str | None = field(default=None, metadata=opt(
        "prefill server(s): host:port[,host:port...] or dns:///name:port (every address the name resolves "
        "to, re-resolved as pods come and go)"))
    mode: str | None = field(default=None, metadata=opt(
        "where prompts are prefilled; default: disaggregated with --prefill-addr, else colocated",
        choices=tuple(PrefillMode)))
    chunk_size: int = field(default=512, metadata=opt(
        "prompt tokens per chunk in chunked mode: a power of two from 16 to 8192"))
    layer_slice_tokens: int = field(default=32768, metadata=opt(
        "layered mode: a prompt's prefill runs as many layers between two decode steps as keep prompt tokens "
        "x layers within this (one layer at least)"))
    prefill_sms: int | None = field(default=None, metadata=opt(
        "partitioned mode: SMs of the green context a prompt's prefill runs on while decode keeps the rest; a "
        "multiple of the GPU's split step (8 on Hopper); default: the split --itl-slo-ms picks"))
    itl_slo_ms: float | None = field(default=None, metadata=opt(
        "partitioned mode: the longest gap between a decoding request's tokens while a prefill runs; picks the "
        "largest --prefill-sms whose measured gap is within it from --sm-split-table (default: twice the "
        "table's decode step alone)"))
    sm_split_table: str | None = field(default=None, metadata=opt(
        "partitioned mode: JSON table of A's gap per prefill SM count (default: the one in decode_server/)"))
    partitioned_short_first: bool = field(default=False, metadata=opt(
        "partitioned mode: a prompt of up to 512 new tokens (a chat's later turn after its cached prefix) is "
        "prefilled between the layers of one of over 2,048 instead of after it; the long prompt's first token "
        "comes later by theirs (needs green contexts)"))
    max_batch_size: int = field(default=64, metadata=opt("most sequences in one decode step"))
    max_waiting_tokens: int = field(default=1 << 20, metadata=opt(
        "token budget: prompt + output tokens of waiting requests; past it, RESOURCE_EXHAUSTED"))
    cuda_graphs: bool = field(default=True, metadata=opt(
        "replay decode steps, and prefills of up to 512 tokens, as CUDA graphs (GPU only)"))
    overlap_steps: bool = field(default=True, metadata=opt(
        "queue each decode step before the last one's tokens are read back, so the GPU does not wait for the "
        "host between steps"))
    prefill_timeout_s: float = field(default=120.0, metadata=opt(
        "longest a remote prefill + KV transfer may take before the request fails UNAVAILABLE"))
    tls_ca: str | None = field(default=None, metadata=opt("PEM CA bundle that signed the prefill servers' TLS "
                                                          "certificates; enables TLS towards them"))
    tls_client_cert: str | None = field(default=None, metadata=opt(
        "PEM certificate this server presents to prefill servers that require one (--tls-client-ca there)"))
    tls_client_key: str | None = field(default=None, metadata=opt("PEM private key for --tls-client-cert"))
    loop_lag_probe_ms: float = field(default=0.0, metadata=opt(
        "every this many ms, hand the event loop a stamped callback from a thread and record how long it "
        "waits to run (what a token from the engine thread waits): metric event_loop_lag_seconds, and each "
        "request log line's loop_lag_max_s from its arrival to its first token, and gc_pause_max_s, the longest "
        "garbage-collector pass in that time; 0 = off"))
    step_trace: str | None = field(default=None, metadata=opt(
        "write one JSON line per decode step (host times and GPU time) and per partitioned prefill to this file, "
        "to find where a slow gap came from (bench.e2e.partitioned_gaps reads it); costs two CUDA events a step"))
    kv_checksum: str = field(default="on", metadata=opt(
        "per-layer checksums of every remote prefill's KV, computed on the device on both sides; a mismatch "
        "fails the request DATA_LOSS and drops the pairing", choices=("on", "off")))
    # mode auto; the defaults come from bench.e2e.auto_thresholds and the prefill rate on two H200s
    # (docs/prefix-cache.md)
    auto_local_mode: str = field(default="colocated", metadata=opt(
        "mode auto: how a prompt kept here is prefilled", choices=LOCAL_MODES))
    auto_local_tokens: int = field(default=512, metadata=opt(
        "mode auto: a prompt with at most this many uncached tokens is prefilled here, even while others decode"))
    auto_idle_local_tokens: int = field(default=1024, metadata=opt(
        "mode auto: at most this many uncached tokens are prefilled here when nobody is decoding"))
    auto_remote_backlog_tokens: int = field(default=98304, metadata=opt(
        "mode auto: while the prefill servers hold this many uncached tokens (their last report, or this "
        "server's remote prefills in flight), new prompts are prefilled here"))
    http_port: int = field(default=8000, metadata=opt("OpenAI-compatible HTTP API port (/v1 on --host); 0 "
                                                       "turns it off"))
    served_model_name: str | None = field(default=None, metadata=opt(
        "the model id the HTTP API lists and takes; default: the checkpoint folder's or preset's name"))
    http_timeout_s: float = field(default=0.0, metadata=opt(
        "longest an HTTP request may take before it ends 504; 0 = no limit"))
    ignore_unknown_fields: bool = field(default=False, metadata=opt(
        "HTTP: take request fields this server does not know with a logged warning, instead of a 400 (for "
        "clients of a newer OpenAI or vLLM API; fields it knows but does not implement are still refused)"))
    http_max_body_bytes: int | None = field(default=None, metadata=opt(
        "HTTP: the largest request body, in bytes after decompression; larger ones get 413 unread. "
        "Default: 32 bytes a token of the context plus 1 MiB, room for a prompt that fills it"))
    default_chat_max_tokens: int = field(default=4096, metadata=opt(
        "max_tokens of a chat request that sends none, capped by the context (a request reserves KV for "
        "all its tokens up front)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode == PrefillMode.DISAGGREGATED and not self.prefill_addr:
            raise ValueError("--mode disaggregated needs --prefill-addr HOST:PORT of a running prefill server")
        if self.loop_lag_probe_ms < 0:
            raise ValueError("--loop-lag-probe-ms must be >= 0 (0 = off)")
        if self.max_batch_size < 1 or self.layer_slice_tokens < 1:
            raise ValueError("--layer-slice-tokens and --max-batch-size must be positive")
        problem = chunk_size_problem(self.chunk_size)
        if problem:
            raise ValueError(f"--chunk-size {problem}")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_client_cert and not self.tls_ca:
            raise ValueError("--tls-client-cert needs --tls-ca, the CA that signed the prefill servers' certificates")
        if self.prefill_sms is not None and self.itl_slo_ms is not None:
            raise ValueError("pass either --prefill-sms or --itl-slo-ms (which picks --prefill-sms), not both")
        if (self.prefill_sms is not None and self.prefill_sms < 1) or (self.itl_slo_ms is not None
                                                                       and not self.itl_slo_ms > 0):
            raise ValueError("--prefill-sms and --itl-slo-ms must be positive")
        if not 0 <= self.http_port < 65536:
            raise ValueError("--http-port must be in 0..65535")
        if self.http_max_body_bytes is not None and self.http_max_body_bytes < 1024:
            raise ValueError("--http-max-body-bytes must be at least 1024")
        if self.http_timeout_s < 0 or self.default_chat_max_tokens < 1:
            raise ValueError("--http-timeout-s must be >= 0 and --default-chat-max-tokens positive")
        if min(self.auto_local_tokens, self.auto_idle_local_tokens, self.auto_remote_backlog_tokens) < 0:
            raise ValueError("--auto-local-tokens, --auto-idle-local-tokens and --auto-remote-backlog-tokens "
                             "must be >= 0")

    @property
    def placement_thresholds(self) -> PlacementThresholds:
        return PlacementThresholds(self.auto_local_tokens, self.auto_idle_local_tokens,
                                   self.auto_remote_backlog_tokens)

    @property
    def default_mode(self) -> PrefillMode:
        if self.mode:
            return PrefillMode(self.mode)
        return PrefillMode.DISAGGREGATED if self.prefill_addr else PrefillMode.COLOCATED


# Fault injection, for tests only; read once at start-up. Declared here and nowhere else.
ENV_FAULT_ENGINE_DIE_AFTER_STEPS = "PD_FAULT_ENGINE_DIE_AFTER_STEPS"


@dataclass(frozen=True)
class DecodeFaults:
    """`PD_FAULT_ENGINE_DIE_AFTER_STEPS=N`: the engine loop raises after N decode steps, so tests can
    see what an engine crash does (health NOT_SERVING, in-flight streams UNAVAILABLE, exit 1)."""

    engine_die_after_steps: int | None = None

    @classmethod
    def from_env(cls) -> DecodeFaults:
        return cls(engine_die_after_steps=env_number(ENV_FAULT_ENGINE_DIE_AFTER_STEPS, int, "a number of steps"))
