"""What the simulator runs: a deployment (N prefill x M decode servers, the mode, the servers' flags)
and the serving loop's own costs around the engine's kernels (`Serving`)."""

from __future__ import annotations

from dataclasses import dataclass

from decode_server.config import DecodeConfig
from planner.network import POOLS

LOCAL_MODES = ("colocated", "chunked", "layered", "partitioned")
MODES = ("disaggregated", *LOCAL_MODES, "auto")


@dataclass(frozen=True)
class Deployment:
    """What runs where: `prefill` prefill servers and `decode` decode servers, and how prompts are placed."""

    prefill: int
    decode: int
    mode: str
    chunk_size: int = 512
    layer_slice_tokens: int = 32_768
    partition_sms: int = 84              # SMs of 132 given to a local prefill in partitioned mode
    prefix_cache: bool = True            # the servers keep conversations' KV (--no-prefix-cache: False)
    # auto: the decode server's own rule and defaults (decode_server.placement, DecodeConfig)
    auto_local_tokens: int = DecodeConfig.auto_local_tokens
    auto_idle_local_tokens: int = DecodeConfig.auto_idle_local_tokens
    auto_remote_backlog_tokens: int = DecodeConfig.auto_remote_backlog_tokens
    auto_local: str = DecodeConfig.auto_local_mode
    max_batch: int = 64
    kv_cache_gb: float = 30.0
    pools: str = "nvlink"                # how the servers sit on nodes (planner.network.POOLS)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: use one of {', '.join(MODES)}")
        if self.auto_local not in LOCAL_MODES:
            raise ValueError(f"--auto-local must be one of {', '.join(LOCAL_MODES)}")
        if self.decode < 1 or self.prefill < 0:
            raise ValueError("a deployment needs at least one decode server and no negative count of prefill servers")
        if self.mode in ("disaggregated", "auto") and self.prefill < 1:
            raise ValueError(f"mode {self.mode} needs at least one prefill server")
        if self.pools not in POOLS:
            raise ValueError(f"unknown pools {self.pools!r}: use one of {', '.join(POOLS)}")

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    def label(self) -> str:
        if self.mode in ("disaggregated", "auto"):
            return f"{self.mode} {self.prefill}P+{self.decode}D" + ("" if self.pools == "nvlink" else f" {self.pools}")
        suffix = f":{self.chunk_size}" if self.mode == "chunked" else ""
        return f"{self.mode}{suffix} {self.decode}D"


@dataclass(frozen=True)
class Serving:
    """Costs of the serving loop around the engine's kernels, calibrated on a load run (planner.validate).

    Host time a decode step spends per running sequence (each token's trip to its stream); time a
    local prefill call (a whole prompt, a chunk or a slice) and a prefill server's prefill take under
    load beyond the engine's own; and what admitting a sequence adds to its first decode step, for a
    locally prefilled one and for one whose KV came from a prefill server (the receive's set-up and
    completion).
    """

    step_host_ms_per_seq: float = 0.0
    local_call_ms: float = 0.0
    remote_prefill_ms: float = 0.0
    join_local_ms: float = 0.0
    join_remote_ms: float = 0.0
